"""A catalogue of GPUs: each card's memory, peak dense FLOP/s per dtype, memory bandwidth and link, with the source of
every figure. ``plan(gpu="h100-sxm")`` and ``autotune report --gpu h100-sxm`` plan for a card by its name; on a real
device, :func:`gpu_for` finds the entry from the name the driver reports (NVML's ``nvmlDeviceGetName``, the same
string as ``torch.cuda.get_device_name``).

Figures:

- ``memory``: bytes, as the CUDA runtime reports the card's total (``torch.cuda.get_device_properties().total_memory``,
  ``cudaDeviceProp.totalGlobalMem``): less than the datasheet's capacity (ECC, the driver's reserve) and a little
  different between drivers. Where no such reading was found, nvidia-smi's total, else the datasheet's capacity in
  GiB (memory parts are binary): ``memory_source`` says which.
- FLOP/s: peak **dense** tensor-core figures (NVIDIA's datasheets print the sparse ones, twice as large, with an
  asterisk: halved here), with FP32 accumulation where the document gives two (GeForce cards: that is what PyTorch's
  matmuls use); ``fp32`` is the non-tensor rate (PyTorch's default for float32 matmuls, TF32 off). None: the card
  has no such units.
- ``bandwidth``: memory bandwidth in bytes/s. ``link``: bytes/s per direction of the link between cards (NVLink on
  SXM parts: the datasheet's total over both directions, halved) or to the host (PCIe x16). ``host_link``: bytes/s per
  direction to the host where ``link`` is NVLink (an SXM part talks to its host over PCIe x16: the datasheet's PCIe
  figure over both directions, halved); :meth:`Gpu.to_host` gives the host's link of any card.

Names are forgiving (``H100 SXM``, ``h100``, ``rtx4090``, ``4090``, ``a100-80gb``): case, spaces, dashes and the
words NVIDIA, GeForce and Tesla do not matter. Where only the form factor is left out, the SXM part is taken (same
memory; its bandwidth and link are the higher ones); a name that leaves the memory open (``a100``, ``v100``) is
refused, since the memory is what a plan depends on most.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["GPUS", "Gpu", "estimate_limit", "gpu_for", "gpu_named", "is_here", "target_for"]

_GiB = 2**30
_MiB = 2**20
_T = 1e12  # tera: FLOP/s and bytes/s
_G = 1e9


@dataclass(frozen=True)
class Gpu:
    """One card's facts (see the module docstring for what each figure counts).

    Attributes:
        name: the canonical name, e.g. ``"h100-sxm"``.
        title: as people write it, e.g. ``"H100 SXM"``.
        capacity: the datasheet's memory, e.g. ``"80 GB HBM3"``.
        memory: bytes the card reports (or the datasheet's capacity: ``memory_source`` says which).
        memory_source: where ``memory`` comes from.
        fp32, tf32, bf16, fp16, fp8, int8: peak dense FLOP/s (int8: operations/s), None where the card has none.
        bandwidth: memory bandwidth, bytes/s.
        link: bytes/s per direction of ``link_kind``.
        link_kind: e.g. ``"NVLink 4"`` or ``"PCIe 4.0 x16"``.
        source: the documents the figures come from.
        nvml_names: the names the driver reports for the card (NVML, ``torch.cuda.get_device_name``).
        aliases: other names it is asked for by.
        host_link: bytes/s per direction of the link to the host where ``link`` is between cards (None: ``link`` is it).
        host_link_kind: e.g. ``"PCIe 5.0 x16"``, where ``host_link`` is given.
    """

    name: str
    title: str
    capacity: str
    memory: int
    memory_source: str
    fp32: float
    tf32: float | None
    bf16: float | None
    fp16: float
    fp8: float | None
    int8: float | None
    bandwidth: float
    link: float
    link_kind: str
    source: str
    nvml_names: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    host_link: float | None = None
    host_link_kind: str | None = None

    def peak(self, dtype: str) -> float | None:
        """Peak dense FLOP/s for ``dtype`` (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"int8"``).

        Raises:
            ValueError: not one of these.
        """
        if dtype not in _DTYPES:
            raise ValueError(f"Invalid dtype {dtype!r}: give one of {', '.join(_DTYPES)}")
        return getattr(self, dtype)  # type: ignore[no-any-return]

    def to_host(self) -> tuple[float, str]:
        """Bytes/s per direction of the card's link to the host, and its kind: ``host_link`` where the card has one apart
        from ``link`` (SXM parts), else ``link`` (PCIe cards)."""
        return (self.host_link, self.host_link_kind or "PCIe") if self.host_link is not None else (self.link, self.link_kind)

    def describe(self) -> str:
        """One line for a plan's notes, e.g. ``"an H100 SXM (80 GB HBM3; 989 TFLOP/s bf16 dense, 3.35 TB/s)"``."""
        dtype, peak = ("bf16", self.bf16) if self.bf16 is not None else ("fp16", self.fp16)
        article = "an" if self.title[0] in "AEFHILMNORSX" else "a"  # as the letter is said: an H100, a T4
        bandwidth = f"{self.bandwidth / _T:.3g} TB/s" if self.bandwidth >= _T else f"{self.bandwidth / _G:.0f} GB/s"
        return f"{article} {self.title} ({self.capacity}; {peak / _T:.0f} TFLOP/s {dtype} dense, {bandwidth})"

    def to_dict(self) -> dict[str, object]:
        """The entry as plain values (for ``--json``)."""
        return {field: getattr(self, field) for field in self.__dataclass_fields__}


_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")

# The documents, by the name NVIDIA gives them.
_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; the 40 GB "
         "cards' bandwidth from the 2020 edition, nvidia-a100-datasheet.pdf)")
_H100 = "NVIDIA H100 Tensor Core GPU datasheet; NVIDIA H100 Tensor Core GPU Architecture whitepaper (the dense figures)"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet"
_L40S = "NVIDIA L40S GPU datasheet"
_A10 = ("NVIDIA A10 Tensor Core GPU datasheet (the A10G is AWS's A10 in its G5 instances, with no datasheet of its own: "
        "the A10's figures)")
_GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix A (GeForce RTX 3090)"
_AD102 = "NVIDIA Ada GPU Architecture whitepaper, appendix A (GeForce RTX 4090)"
_T4 = "NVIDIA T4 Tensor Core GPU datasheet"
_V100 = "NVIDIA V100 Tensor Core GPU datasheet (SXM2)"

# An SXM part's link to its host, beside its NVLink: PCIe x16, per direction. The A100 datasheet gives "PCIe Gen4: 64GB/s"
# for the SXM cards too, the H100 and H200 datasheets "PCIe Gen5: 128GB/s" (both directions); the V100 datasheet gives the
# PCIe card's 32 GB/s (PCIe 3.0 x16, which the SXM2 card's host link is).
_PCIE3_HOST: dict[str, Any] = {"host_link": 16e9, "host_link_kind": "PCIe 3.0 x16"}
_PCIE4_HOST: dict[str, Any] = {"host_link": 32e9, "host_link_kind": "PCIe 4.0 x16"}
_PCIE5_HOST: dict[str, Any] = {"host_link": 64e9, "host_link_kind": "PCIe 5.0 x16"}


def _reported(mib: int, where: str) -> tuple[int, str]:
    return mib * _MiB, f"as PyTorch reports it ({mib} MiB, total_memory), {where}"


def _smi(mib: int, where: str) -> tuple[int, str]:
    return mib * _MiB, f"as nvidia-smi reports its total ({mib} MiB), {where}; the CUDA runtime may report a little less"


def _datasheet(gib: int, why: str = "") -> tuple[int, str]:
    return gib * _GiB, f"the datasheet's capacity ({gib} GiB){why}; the card reports a little less"


_CARDS = (
    Gpu("a100-40gb-sxm", "A100 SXM 40GB", "40 GB HBM2",
        *(42_298_834_944, "as the CUDA runtime reports it (40339 MiB, deviceQuery's totalGlobalMem)"),
        fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12, fp8=None, int8=624e12,
        bandwidth=1555e9, link=300e9, link_kind="NVLink 3", source=_A100,
        nvml_names=("NVIDIA A100-SXM4-40GB",), aliases=("a100-40gb", "a100-sxm4-40gb"), **_PCIE4_HOST),
    Gpu("a100-40gb-pcie", "A100 PCIe 40GB", "40 GB HBM2", *_reported(40326, "driver of 2021"),
        fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12, fp8=None, int8=624e12,
        bandwidth=1555e9, link=32e9, link_kind="PCIe 4.0 x16", source=_A100,
        nvml_names=("NVIDIA A100-PCIE-40GB",)),
    Gpu("a100-80gb-sxm", "A100 SXM 80GB", "80 GB HBM2e",
        *_datasheet(80, " (nvidia-smi shows 81920 MiB; the CUDA runtime reports 81049 MiB for the 80GB PCIe card)"),
        fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12, fp8=None, int8=624e12,
        bandwidth=2039e9, link=300e9, link_kind="NVLink 3", source=_A100,
        nvml_names=("NVIDIA A100-SXM4-80GB",), aliases=("a100-80gb", "a100-sxm4-80gb"), **_PCIE4_HOST),
    Gpu("a100-80gb-pcie", "A100 PCIe 80GB", "80 GB HBM2e",
        *(81049 * _MiB, "as the CUDA runtime reports it (81049 MiB, totalGlobalMem; driver of CUDA 12.3)"),
        fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12, fp8=None, int8=624e12,
        bandwidth=1935e9, link=32e9, link_kind="PCIe 4.0 x16", source=_A100,
        nvml_names=("NVIDIA A100 80GB PCIe",)),
    Gpu("h100-sxm", "H100 SXM", "80 GB HBM3", *_reported(81082, "driver of CUDA 11.8 (newer drivers: 81089 MiB)"),
        fp32=66.9e12, tf32=494.7e12, bf16=989.4e12, fp16=989.4e12, fp8=1978.9e12, int8=1978.9e12,
        bandwidth=3.35e12, link=450e9, link_kind="NVLink 4", source=_H100,
        nvml_names=("NVIDIA H100 80GB HBM3",), aliases=("h100", "h100-sxm5", "h100-80gb", "h100-80gb-hbm3"), **_PCIE5_HOST),
    Gpu("h100-pcie", "H100 PCIe", "80 GB HBM2e", *_reported(81008, "driver of 2023"),
        fp32=51.2e12, tf32=378e12, bf16=756e12, fp16=756e12, fp8=1513e12, int8=1513e12,
        bandwidth=2.0e12, link=64e9, link_kind="PCIe 5.0 x16", source=_H100,
        nvml_names=("NVIDIA H100 PCIe",)),
    Gpu("h200", "H200 SXM", "141 GB HBM3e", *_reported(143771, "measured on an H200 with driver 580.159 (2026-12-04)"),
        fp32=67e12, tf32=989e12 / 2, bf16=1979e12 / 2, fp16=1979e12 / 2, fp8=3958e12 / 2, int8=3958e12 / 2,
        bandwidth=4.8e12, link=450e9, link_kind="NVLink 4", source=_H200,
        nvml_names=("NVIDIA H200",), aliases=("h200-sxm", "h200-141gb"), **_PCIE5_HOST),
    Gpu("l4", "L4", "24 GB GDDR6", *_smi(23034, "ECC on, drivers of 2023-2026"),
        fp32=30.3e12, tf32=120e12 / 2, bf16=242e12 / 2, fp16=242e12 / 2, fp8=485e12 / 2, int8=485e12 / 2,
        bandwidth=300e9, link=32e9, link_kind="PCIe 4.0 x16", source=_L4,
        nvml_names=("NVIDIA L4",)),
    Gpu("l40s", "L40S", "48 GB GDDR6", *_reported(45589, "ECC on"),
        fp32=91.6e12, tf32=366e12 / 2, bf16=733e12 / 2, fp16=733e12 / 2, fp8=1466e12 / 2, int8=1466e12 / 2,
        bandwidth=864e9, link=32e9, link_kind="PCIe 4.0 x16", source=_L40S,
        nvml_names=("NVIDIA L40S",)),
    Gpu("a10g", "A10G", "24 GB GDDR6", *_reported(22587, "ECC on (AWS G5)"),
        fp32=31.2e12, tf32=125e12 / 2, bf16=250e12 / 2, fp16=250e12 / 2, fp8=None, int8=500e12 / 2,
        bandwidth=600e9, link=32e9, link_kind="PCIe 4.0 x16", source=_A10,
        nvml_names=("NVIDIA A10G",)),
    Gpu("rtx3090", "RTX 3090", "24 GB GDDR6X", *_reported(24259, "on Linux"),
        fp32=35.6e12, tf32=35.6e12, bf16=142e12 / 2, fp16=142e12 / 2, fp8=None, int8=568e12 / 2,
        bandwidth=936e9, link=32e9, link_kind="PCIe 4.0 x16", source=_GA102,
        nvml_names=("NVIDIA GeForce RTX 3090",), aliases=("3090", "geforce-rtx-3090")),
    Gpu("rtx4090", "RTX 4090", "24 GB GDDR6X", *_reported(24563, "on Linux"),
        fp32=82.6e12, tf32=165.2e12 / 2, bf16=330.4e12 / 2, fp16=330.4e12 / 2, fp8=660.6e12 / 2, int8=1321.2e12 / 2,
        bandwidth=1008e9, link=32e9, link_kind="PCIe 4.0 x16", source=_AD102,
        nvml_names=("NVIDIA GeForce RTX 4090",), aliases=("4090", "geforce-rtx-4090")),
    Gpu("t4", "T4", "16 GB GDDR6", *_reported(15095, "ECC on (readings from 14930 to 15109 MiB across drivers)"),
        fp32=8.1e12, tf32=None, bf16=None, fp16=65e12, fp8=None, int8=130e12,
        bandwidth=320e9, link=16e9, link_kind="PCIe 3.0 x16", source=_T4,
        nvml_names=("Tesla T4", "NVIDIA T4")),
    Gpu("v100-16gb", "V100 SXM2 16GB", "16 GB HBM2", *_reported(16160, "drivers of 2020-2021"),
        fp32=15.7e12, tf32=None, bf16=None, fp16=125e12, fp8=None, int8=None,
        bandwidth=900e9, link=150e9, link_kind="NVLink 2", source=_V100,
        nvml_names=("Tesla V100-SXM2-16GB",), aliases=("v100-sxm2-16gb",), **_PCIE3_HOST),
    Gpu("v100-32gb", "V100 SXM2 32GB", "32 GB HBM2", *_smi(32510, "as for the 16 GB card, where it equals PyTorch's total_memory"),
        fp32=15.7e12, tf32=None, bf16=None, fp16=125e12, fp8=None, int8=None,
        bandwidth=900e9, link=150e9, link_kind="NVLink 2", source=_V100,
        nvml_names=("Tesla V100-SXM2-32GB",), aliases=("v100-sxm2-32gb",), **_PCIE3_HOST),
)

GPUS: dict[str, Gpu] = {card.name: card for card in _CARDS}


def _key(name: str) -> tuple[str, ...]:
    """A name's words, in any order: letters and digits apart, the maker's words and SXM's generation dropped."""
    words = re.findall(r"[a-z]+|\d+", re.sub(r"sxm\d", "sxm", name.lower()))
    return tuple(sorted(w for w in words if w not in ("nvidia", "geforce", "tesla")))


_BY_KEY: dict[tuple[str, ...], Gpu] = {}
for _card in _CARDS:
    for _name in (_card.name, _card.title, *_card.aliases, *_card.nvml_names):
        assert _BY_KEY.setdefault(_key(_name), _card) is _card, _name  # no name means two cards


_AMBIGUOUS = {_key("a100"): "a100-40gb or a100-80gb (the SXM cards; -pcie for the PCIe ones)",
              _key("a100 pcie"): "a100-40gb-pcie or a100-80gb-pcie", _key("v100"): "v100-16gb or v100-32gb"}


def gpu_named(name: str) -> Gpu:
    """The catalogue's entry for ``name`` (forgiving: see the module docstring).

    Raises:
        ValueError: not a name of the catalogue; the message lists them.

    Example:
        >>> gpu_named("H100 SXM").name, gpu_named("4090").name
        ('h100-sxm', 'rtx4090')
    """
    if not isinstance(name, str):
        raise TypeError(f"Invalid gpu {name!r}: give a card's name as a string, e.g. gpu='h100-sxm'")
    key = _key(name)
    if key in _BY_KEY:
        return _BY_KEY[key]
    if key in _AMBIGUOUS:
        raise ValueError(f"Invalid gpu {name!r}: it does not say the card's memory; give {_AMBIGUOUS[key]}")
    raise ValueError(f"Invalid gpu {name!r}: not a card the catalogue knows; give one of {', '.join(GPUS)}")


def gpu_for(nvml_name: str) -> Gpu | None:
    """The entry for the name a real device reports (NVML's ``nvmlDeviceGetName``, ``torch.cuda.get_device_name``),
    e.g. ``"NVIDIA H100 80GB HBM3"``; None for a card the catalogue lacks (an ``"NVIDIA H100 NVL"`` is not an H100
    SXM: the names are matched whole, older drivers' names without ``"NVIDIA "`` too)."""
    given = nvml_name.strip().lower().removeprefix("nvidia ")
    for card in _CARDS:
        if any(given == n.lower().removeprefix("nvidia ") for n in card.nvml_names):
            return card
    return None


def is_here(card: Gpu, index: int | None = None) -> bool:
    """Whether this machine's CUDA device ``index`` (default: the current one) is ``card``, by the name its driver
    reports (torch's ``get_device_name``, NVML's name)."""
    import torch

    if not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if index is None else index
    return index < torch.cuda.device_count() and gpu_for(torch.cuda.get_device_name(index)) is card


def estimate_limit(card: Gpu, given: int | None, *, flag: str = "memory_limit") -> tuple[int, str]:
    """The limit of an estimate for ``card`` (a card not on this machine) and the note that says so: its memory, or
    ``given`` (``flag``: how the user gave it) where given, at most the card's memory (5% above it is the card's
    total as its maker counts it: "24GiB" for a 23.99 GiB card).

    Raises:
        ValueError: ``given`` is more than the card has.
    """
    from autotune.units import format_bytes

    if given is not None and given > card.memory * 1.05:
        raise ValueError(f"Invalid {flag} {format_bytes(given)} with gpu {card.name!r}: {card.describe()} has "
                         f"{format_bytes(card.memory)}; give at most that, or leave {flag} out")
    said = (f"{flag} {format_bytes(given)} given: planned with it instead of the card's {format_bytes(card.memory)}"
            if given is not None else f"its memory {format_bytes(card.memory)}, {card.memory_source}")
    return (card.memory if given is None else given), f"planned for {card.describe()}, estimated (no such card here); {said}"


def target_for(card: Gpu, device: Any, memory_limit: int | None, verify: bool) -> tuple[Any, bool, int | None, str]:
    """``plan(gpu=...)``: the device, whether to run on it, the limit and the note. On this machine's CUDA device where it is
    that card (by the name its driver reports), as asked; else an estimate for it, with its memory as the limit."""
    import torch

    wanted = torch.device(device) if device is not None else torch.device("cuda")
    if wanted.type != "cuda":
        raise ValueError(f"Invalid device {str(wanted)!r} with gpu={card.name!r}: the card is a CUDA device; leave device "
                         "out, or give device='cuda' (or 'cuda:N')")
    limit, note = estimate_limit(card, memory_limit)  # refused here too: a limit above the card's memory
    if is_here(card, wanted.index):
        index = wanted.index if wanted.index is not None else torch.cuda.current_device()
        return torch.device("cuda", index), verify, memory_limit, f"planned for {card.describe()}: this machine's cuda:{index}"
    return wanted, False, limit, note
