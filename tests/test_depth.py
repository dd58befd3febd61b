"""Estimates whose cost does not grow with depth: a model of repeated blocks is traced with copies of 2, 3
and 4 of them and extended to its depth (autotune.probe.depth). The reference is the same model traced
whole, the estimate before the extension existed."""

import types
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autotune
from autotune.probe import depth, estimate, stacks

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402
from test_estimate import text_batch  # noqa: E402


def plan_both(make, loader, monkeypatch, device="cpu", **kw):
    """The estimate-only plan of the model with the extension and traced whole, each from nothing kept."""
    plans = []
    for extend in (True, False):
        estimate.forget()
        with monkeypatch.context() as m:
            if not extend:
                m.setattr(stacks, "repeated_stacks", lambda work: ([], None))
            model = make()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            plans.append(autotune.plan(model, loader, optimizer=opt, device=device, headroom=0, verify=False, progress=False, **kw))
    return plans


def t5(layers=16):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=500, d_model=64, d_kv=16, d_ff=128, num_layers=layers,
                                               num_decoder_layers=layers, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0))


def image_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(8, 3, 32, 32, generator=g), "labels": torch.randint(0, 10, (8,), generator=g)}


def seq2seq_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 500, (8, 32), generator=g), "attention_mask": torch.ones(8, 32, dtype=torch.long),
            "labels": torch.randint(0, 500, (8, 16), generator=g)}


def whisper(layers=12):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=500, num_mel_bins=16, encoder_layers=layers, decoder_layers=layers, d_model=64, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=32, max_target_positions=64,
        pad_token_id=0, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2))


def audio_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_features": torch.randn(8, 16, 64, generator=g), "labels": torch.randint(3, 500, (8, 20), generator=g)}


CASES = {
    "gpt2": (lambda: hf_models.gpt2(layers=12), lambda s: text_batch(8, 64, seed=s), "transformer.h at 2, 3 and 4 of its 12 blocks"),
    "llama": (lambda: hf_models.llama(layers=12), lambda s: text_batch(8, 64, seed=s), "model.layers at 2, 3 and 4 of its 12 blocks"),
    "bert": (lambda: hf_models.bert(layers=12), lambda s: text_batch(8, 64, labels="cls", seed=s), "bert.encoder.layer at 2, 3 and 4 of its 12 blocks"),
    "vit": (lambda: hf_models.vit(layers=12), image_batch, "vit.layers at 2, 3 and 4 of its 12 blocks"),
    # T5's first block alone holds the relative position bias: kept whole in every copy, one copy more per stack.
    "t5": (t5, seq2seq_batch, "encoder.block at 3, 4 and 5 of its 16 blocks and decoder.block at 3, 4 and 5 of its 16 blocks"),
    # two stacks of 12: the curve of the full depth is confirmed at the size found, not only the deepest copy's
    "whisper": (whisper, audio_batch, "model.encoder.layers at 2, 3 and 4 of its 12 blocks and model.decoder.layers at 2, 3 and 4 of its 12 blocks"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_deep_model_extended_from_few_blocks_plans_as_traced_whole(name, monkeypatch):
    make, batch, traced = CASES[name]
    loader = [batch(s) for s in range(2)]
    extended, reference = plan_both(make, loader, monkeypatch, target_batch=4096, memory_limit="100MiB")
    assert any(traced in n and "extended" in n for n in extended.notes), extended.notes
    assert not any("extended" in n for n in reference.notes)
    assert extended.micro_batch == reference.micro_batch and 4 < extended.micro_batch < 4096
    assert abs(extended.peak_memory / reference.peak_memory - 1) <= 0.005
    assert extended.peak_memory == reference.peak_memory  # measured: the same to the byte on these models


CUDA_CASES = {
    "gpt2": (lambda: hf_models.gpt2(layers=14), lambda s: text_batch(8, 64, seed=s), "transformer.h at 3, 4 and 5 of its 14 blocks"),
    "llama": (lambda: hf_models.llama(layers=14), lambda s: text_batch(8, 64, seed=s), "model.layers at 3, 4 and 5 of its 14 blocks"),
    "bert": (lambda: hf_models.bert(layers=14), lambda s: text_batch(8, 64, labels="cls", seed=s), "bert.encoder.layer at 3, 4 and 5 of its 14 blocks"),
    "vit": (lambda: hf_models.vit(layers=14), image_batch, "vit.layers at 3, 4 and 5 of its 14 blocks"),
}


@pytest.mark.parametrize("name", sorted(CUDA_CASES))
def test_for_cuda_the_allocator_s_replay_of_the_extended_step_is_the_whole_model_s(name, monkeypatch):
    """For a CUDA target the caching allocator's reserved bytes come from a replay of every allocation: the
    full depth's are made from the copies' blocks (one block more past the prefix) and replayed."""
    make, batch, traced = CUDA_CASES[name]
    loader = [batch(s) for s in range(2)]
    extended, reference = plan_both(make, loader, monkeypatch, device="cuda", target_batch=4096, memory_limit="1GiB", precision="bf16")
    assert any(traced in n and "extended" in n for n in extended.notes), extended.notes
    assert extended.micro_batch == reference.micro_batch and 4 < extended.micro_batch < 4096
    assert extended.peak_memory == reference.peak_memory  # the reserved bytes, to the byte
    said = [n for n in extended.notes if "caching allocator reserves" in n]
    assert said == [n for n in reference.notes if "caching allocator reserves" in n]


class Mixed(nn.Module):
    """Twelve blocks of two widths, alternating: not one repeated structure."""

    def __init__(self, n=12):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64 if i % 2 else 128), nn.ReLU(), nn.Linear(64 if i % 2 else 128, 32)) for i in range(n))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


class Growing(nn.Module):
    """Twelve blocks alike whose forward keeps what every earlier block made (a dense connection): the
    bytes a block adds grow with its depth."""

    def __init__(self, n=12):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(n))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        seen = x
        for b in self.blocks:
            x = torch.relu(b(x)) + (seen * seen).mean(dim=1, keepdim=True)  # saves seen for the backward
            seen = torch.cat([seen, x.repeat(1, 32)], dim=1)  # 4 KiB a sample more for each block
        return self.head(x)


def mse(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("cls, why", [(Mixed, "are not alike"), (Growing, "not the same block to block")])
def test_blocks_that_differ_or_grow_with_depth_are_traced_whole_and_a_note_says_why(cls, why, monkeypatch):
    loader = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(2)]
    extended, reference = plan_both(lambda: (torch.manual_seed(0), cls())[1], loader, monkeypatch, target_batch=4096,
                                    memory_limit="8MiB", loss_fn=mse)
    assert any("traced the whole model" in n and why in n for n in extended.notes), extended.notes
    assert (extended.micro_batch, extended.peak_memory) == (reference.micro_batch, reference.peak_memory)
    assert 4 < extended.micro_batch < 4096


def test_the_copies_share_the_model_s_parameters_and_leave_it_as_it_was():
    model = hf_models.gpt2(layers=12)
    cut = stacks.truncated(model, {"transformer.h": 3})
    assert len(cut.transformer.h) == 3 and len(model.transformer.h) == 12
    assert cut.transformer.h[2].attn.c_attn.weight is model.transformer.h[2].attn.c_attn.weight
    assert cut.lm_head.weight is cut.transformer.wte.weight  # the tie kept
    found, why = stacks.repeated_stacks(SimpleNamespace(model=model, device=torch.device("cpu")))
    assert [(s.path, s.depth, s.prefix, s.kinds) for s in found] == [("transformer.h", 12, 0, ())] and why is None
    short, why = stacks.repeated_stacks(SimpleNamespace(model=hf_models.gpt2(layers=8), device=torch.device("cpu")))
    assert short == [] and "8 blocks of transformer.h are too few to extend" in why  # 9 blocks traced would save none: said
    assert stacks.repeated_stacks(SimpleNamespace(model=hf_models.gpt2(layers=4), device=torch.device("cpu"))) == ([], None)


def rebound_checkpointing(model, blocks):
    """Activation checkpointing on ``blocks`` as it is often written by hand: each block's ``forward`` rebound (as a
    method of the block, so that a copy of the model calls its own block)."""
    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(type(self).forward, self, *args, use_reentrant=False, **kwargs)

    for block in blocks:
        block.forward = types.MethodType(forward, block)
    model.config.use_cache = False  # as Transformers' own checkpointing sets it: the recomputed forward must not grow a cache
    return model


def scaled_by_a_hook(model, blocks):
    """A forward hook on ``blocks`` that replaces each block's output with a new tensor (kept for the backward)."""
    def hook(module, args, out):
        return (out[0] * 1.5, *out[1:]) if isinstance(out, tuple) else out * 1.5

    for block in blocks:
        block.register_forward_hook(hook)
    return model


@pytest.mark.parametrize("change", [rebound_checkpointing, scaled_by_a_hook], ids=["rebound-forward", "forward-hook"])
def test_blocks_changed_on_the_instance_are_not_taken_for_alike(change, monkeypatch):
    """Six of twelve blocks checkpointed by rebinding ``forward``, or given a hook: the class and the weights are the
    same, what runs is not; priced as the first blocks, every block would be checkpointed (or hooked)."""
    def make():
        model = hf_models.gpt2(layers=12)
        return change(model, model.transformer.h[:6])

    loader = [text_batch(8, 64, seed=s) for s in range(2)]
    extended, reference = plan_both(make, loader, monkeypatch, target_batch=4096, memory_limit="100MiB")
    assert any("traced the whole model" in n and "6 of them unlike the rest" in n for n in extended.notes), extended.notes
    assert (extended.micro_batch, extended.peak_memory) == (reference.micro_batch, reference.peak_memory)
    found, _ = stacks.repeated_stacks(SimpleNamespace(model=change(hf_models.gpt2(layers=24), []), device=torch.device("cpu")))
    assert [s.depth for s in found] == [24]  # the same change on no block, or (below) on every block: alike, extended
    every = hf_models.gpt2(layers=24)
    found, _ = stacks.repeated_stacks(SimpleNamespace(model=change(every, every.transformer.h), device=torch.device("cpu")))
    assert [(s.depth, s.prefix) for s in found] == [(24, 0)]


def bert_large():
    """BERT-large's shape (24 layers of 1024, 16 heads, MLP 4096, 512 positions) as a sequence classifier, on the meta
    device."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab_size=30522,
                        max_position_embeddings=512, num_labels=2)
    with torch.device("meta"):
        return BertForSequenceClassification(config)


@pytest.mark.parametrize("device, precision", [("cpu", "fp32"), ("cuda", "fp16")])
def test_bert_large_s_shape_is_extended_and_plans_as_traced_whole(device, precision, monkeypatch):
    ids = torch.randint(0, 30522, (1, 512), generator=torch.Generator().manual_seed(0))
    loader = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([1])}]
    extended, reference = plan_both(bert_large, loader, monkeypatch, device=device, target_batch=64, memory_limit="16GiB",
                                    precision=precision)
    blocks = "2, 3 and 4" if device == "cpu" else "3, 4 and 5"
    assert any(f"bert.encoder.layer at {blocks} of its 24 blocks" in n and "extended" in n for n in extended.notes), extended.notes
    assert (extended.micro_batch, extended.peak_memory) == (reference.micro_batch, reference.peak_memory)
    assert 1 < extended.micro_batch < 64


def qwen3_alternating(layers):
    """Qwen3 with a sliding window on every other layer (``layer_types``): the layers differ in a setting alone."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=500, max_position_embeddings=256, use_sliding_window=True, sliding_window=16, max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2)))


def gemma3_text(layers):
    """Gemma-3's text model: five sliding-window layers to one full-attention layer."""
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM

    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=500, max_position_embeddings=256, sliding_window=16))


def gemma2(layers):
    """Gemma-2: sliding-window and full-attention layers alternating, eager attention (its default: both masks held)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, vocab_size=500, max_position_embeddings=256, sliding_window=16)
    config._attn_implementation = "eager"
    return Gemma2ForCausalLM(config)


@pytest.mark.parametrize("make, layers, kinds", [
    (qwen3_alternating, 12, "self_attn.layer_type, self_attn.sliding_window"),
    (gemma2, 16, "self_attn.layer_type, self_attn.sliding_window"),
], ids=["qwen3-layer-types", "gemma2-eager"])
def test_layers_of_two_attention_types_are_extended_where_each_kind_holds_the_same(make, layers, kinds, monkeypatch):
    """Layers alike but for their attention type (sliding window or full), each holding a mask of one size (padded
    batches; Gemma-2's eager attention): extended from copies of the first ones, with a copy whose last block is one of
    the other kind (and the config's layer_types, which the model reads by the block's place, saying so) checked to hold
    the same, figure for figure; the plan is the one the whole model's trace gives, to the byte. They used to be traced
    whole ("not alike"); for a CUDA target they still are (said)."""
    loader = [text_batch(8, 64, seed=s) for s in range(2)]
    model = make(layers)
    types = {layer.self_attn.sliding_window is None for layer in model.model.layers}
    assert types == {True, False}  # both kinds in the stack, the test's premise
    extended, reference = plan_both(lambda: make(layers), loader, monkeypatch, target_batch=4096, memory_limit="100MiB")
    note = next(n for n in extended.notes if n.startswith("the estimate traced model.layers"))
    assert f"(2 kinds of blocks, alike but for {kinds}: each checked to add the same bytes" in note, note
    assert (extended.micro_batch, extended.peak_memory) == (reference.micro_batch, reference.peak_memory)
    assert 4 < extended.micro_batch < 4096
    found, why = stacks.repeated_stacks(SimpleNamespace(model=model, device=torch.device("cuda")))
    assert found == [] and f"the blocks of model.layers are not alike ({layers // 2} of {layers} differ from the last)" in why


def test_gemma3_s_full_layers_hold_less_than_its_sliding_ones_so_it_is_traced_whole(monkeypatch):
    """Gemma-3 without padding: a full-attention layer runs without a mask, a sliding one with its window's (the model
    picks each layer's mask by its place in config.layer_types), so a copy with a full layer last holds less than the
    deepest copy; the whole model is traced and the note says why. Extended as if every layer were sliding, the plan
    held 2% more than the model does (the swapped layer had been given the sliding mask of the place it took)."""
    ids = torch.randint(0, 500, (1, 128), generator=torch.Generator().manual_seed(0))
    loader = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
    extended, reference = plan_both(lambda: gemma3_text(18), loader, monkeypatch, target_batch=4096, memory_limit="100MiB")
    assert any("traced the whole model" in n and "a block of another kind last in the deepest copy makes" in n for n in extended.notes), extended.notes
    assert (extended.micro_batch, extended.peak_memory) == (reference.micro_batch, reference.peak_memory)


class Gated(nn.Module):
    """A block whose setting picks what its forward saves: gated (SiLU times a gate: more saved for the backward) or not."""

    def __init__(self, gated):
        super().__init__()
        self.gated = gated
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        h = self.up(x)
        return x + self.down(nn.functional.silu(h) * torch.sigmoid(h) if self.gated else torch.relu(h))


class Kinds(nn.Module):
    def __init__(self, n=14):
        super().__init__()
        self.blocks = nn.ModuleList(Gated(i % 6 == 5) for i in range(n))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_kinds_of_blocks_that_hold_other_bytes_are_traced_whole_and_the_note_says_why(monkeypatch):
    """Blocks alike but for a setting (gated every sixth, past the copies) whose kinds save different bytes: the copy with a gated block
    last holds more than the deepest copy, so the whole model is traced, and the note says so."""
    found, _ = stacks.repeated_stacks(SimpleNamespace(model=Kinds(), device=torch.device("cpu")))
    assert [(s.depth, s.prefix, len(s.kinds)) for s in found] == [(14, 0, 2)]
    loader = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(2)]
    extended, reference = plan_both(lambda: (torch.manual_seed(0), Kinds())[1], loader, monkeypatch, target_batch=4096,
                                    memory_limit="8MiB", loss_fn=mse)
    assert any("traced the whole model" in n and "a block of another kind last in the deepest copy makes" in n for n in extended.notes), extended.notes
    assert (extended.micro_batch, extended.peak_memory) == (reference.micro_batch, reference.peak_memory)


def test_two_stacks_for_cuda_are_traced_whole_and_the_note_says_why():
    model = t5()
    work = SimpleNamespace(model=model, device=torch.device("cuda"))
    assert len(stacks.repeated_stacks(work)[0]) == 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    estimate.forget()
    made = estimate.estimator_for(estimate.Workload(model=model, optimizer=opt, loss_fn=lambda m, b: m(**b).loss, batch=seq2seq_batch(),
                                                    device=torch.device("cuda"), precision="fp32"))
    assert made.note == ("the estimate traced the whole model: its 2 stacks of blocks (encoder.block, decoder.block) are extended "
                         "for the CPU only, not for CUDA's allocator")


class Workspace(nn.Module):
    """A block whose forward may make and drop a workspace padded to a power of two of the batch: an allocation
    whose bytes are not affine in the micro-batch, freed at once, so never at the peak."""

    def __init__(self, workspace):
        super().__init__()
        self.workspace = workspace
        self.up, self.down = nn.Linear(128, 512), nn.Linear(512, 128)

    def forward(self, x):
        if self.workspace:
            with torch.no_grad():
                x.new_zeros(1 << x.shape[0].bit_length())
        return x + self.down(torch.relu(self.up(x)))


class Blocks(nn.Module):
    def __init__(self, workspace, n=14):
        super().__init__()
        self.blocks = nn.ModuleList(Workspace(workspace) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("workspace", [False, True])
def test_for_cuda_the_size_found_is_confirmed_on_the_deepest_copy_alone_where_its_allocations_are_on_their_lines(workspace, monkeypatch):
    """For a CUDA target the curve of the full depth holds at the size found when every allocation the deepest copy
    makes there is the one its two traces' lines give: one trace at that size, not one of each copy. A workspace
    off its line (padded to a power of two) sends the confirmation back to every copy's trace there. Either way the
    plan is the whole model's, to the byte, and so are its trials, the size found listed."""
    made = []
    trace = estimate.Trace

    def counting(*args, **kwargs):
        made.append(1)
        return trace(*args, **kwargs)

    def mse(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    loader = [(torch.randn(16, 128), torch.randn(16, 128)) for _ in range(2)]
    monkeypatch.setattr(estimate, "Trace", counting)
    extended, reference = plan_both(lambda: (torch.manual_seed(0), Blocks(workspace))[1], loader, monkeypatch, device="cuda",
                                    target_batch=4096, memory_limit="900MiB", loss_fn=mse)
    assert any("at 3, 4 and 5 of its 14 blocks" in n for n in extended.notes), extended.notes
    assert 16 < extended.micro_batch < 4096 and extended.micro_batch & (extended.micro_batch - 1)  # not at a power of two
    assert (extended.micro_batch, extended.peak_memory) == (reference.micro_batch, reference.peak_memory)
    whole = 3  # the whole model's: two sizes, and the size found
    assert len(made) - whole == (9 if workspace else 7)  # three copies at two sizes, and the size found: one copy or three
    # the trials the plan lists are the whole model's, the size its curve found among them (left out where one copy confirmed it)
    listed = [[(t.batch_size, t.peak_memory, t.fits) for t in p.trials] for p in (extended, reference)]
    assert listed[0] == listed[1] and len(listed[0]) == 3, listed


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["for the cpu", "estimated for cuda"])  # "cuda" alone marks a test for a GPU
def test_a_plan_from_kept_copies_lists_their_traces_as_trials_made_earlier(device):
    """A second plan of the same model reads the copies' traces the first made: its trials are the same sizes, each
    made earlier (0 s), as a model traced whole lists its kept traces; not an empty table."""
    estimate.forget()
    layers = 16 if device == "cuda" else 12  # a CUDA target copies more blocks
    model = hf_models.llama(layers=layers)
    plans = [autotune.plan(model, [text_batch(8, 64)], target_batch=64, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                           device=device, memory_limit="1GiB", precision="bf16" if device == "cuda" else "fp32", headroom=0,
                           verify=False, progress=False) for _ in range(2)]
    first, second = plans
    assert any(f"of its {layers} blocks" in n for n in first.notes), first.notes  # the copies, not the whole model
    assert first.trials and any(t.seconds > 0 for t in first.trials)
    assert [(t.batch_size, t.peak_memory, t.fits) for t in second.trials] == [(t.batch_size, t.peak_memory, t.fits) for t in first.trials]
    assert all(t.seconds == 0 and t.estimate for t in second.trials)
    assert (second.micro_batch, second.peak_memory) == (first.micro_batch, first.peak_memory)
