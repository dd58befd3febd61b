import pytest
import torch

from autotune import batches as B


def test_batch_size_of_each_container():
    x, y = torch.zeros(5, 3), torch.zeros(5, dtype=torch.long)
    assert B.batch_size(x) == 5
    assert B.batch_size((x, y)) == 5
    assert B.batch_size([x, y]) == 5
    assert B.batch_size({"input_ids": x, "labels": y, "flag": True}) == 5


def test_batch_size_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"disagree on the batch size \(dim 0 sizes \[5, 4\]\)"):
        B.batch_size((torch.zeros(5, 3), torch.zeros(4)))
    with pytest.raises(ValueError, match="0-d tensor"):
        B.batch_size((torch.zeros(5, 3), torch.tensor(1.0)))
    with pytest.raises(TypeError, match="holds no tensor"):
        B.batch_size({"a": 1})


def test_a_dict_batch_that_disagrees_names_each_tensor_by_its_key_and_says_why_image_patches_cannot_be_cut():
    """A batch as Qwen2-VL's processor makes it: one image of 4x4 patches of 14 pixels, each a row of 3 x 2 x 14 x 14 values,
    in one tensor beside its grid. The error names which tensor is off and why such a batch cannot be cut."""
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 8, dtype=torch.long),
             "pixel_values": torch.zeros(16, 1176), "image_grid_thw": torch.tensor([[1, 4, 4]]), "labels": torch.zeros(1, 8, dtype=torch.long)}
    with pytest.raises(ValueError) as raised:
        B.batch_size(batch)
    message = str(raised.value)
    assert ("(dim 0 sizes [1, 1, 16, 1, 1]: input_ids 1, attention_mask 1, pixel_values 16, image_grid_thw 1, labels 1)" in message
            and "a row a patch, not a sample, and cannot be cut into micro-batches" in message), message
    with pytest.raises(ValueError, match=r"dim 0 sizes \[3, 2\]: x 3, more\.y\[0\] 2\)"):
        B.batch_size({"x": torch.zeros(3), "more": {"y": [torch.zeros(2)]}})


def test_repeat_to_takes_real_samples_cyclically():
    x = torch.arange(6).reshape(3, 2)
    y = torch.tensor([10, 11, 12])
    big = B.repeat_to({"x": x, "y": y, "note": "keep"}, 7)
    assert big["y"].tolist() == [10, 11, 12, 10, 11, 12, 10]
    assert torch.equal(big["x"][3], x[0])
    assert big["note"] == "keep"
    small = B.repeat_to((x, y), 2)
    assert small[1].tolist() == [10, 11]


def test_slice_and_concat_round_trip():
    batch = (torch.randn(10, 4), torch.arange(10))
    parts = [B.slice_batch(batch, 0, 3), B.slice_batch(batch, 3, 10)]
    joined = B.concat(parts)
    assert torch.equal(joined[0], batch[0]) and torch.equal(joined[1], batch[1])


def test_per_sample_numel_finds_longer_sequences():
    short = {"ids": torch.zeros(8, 16), "mask": torch.zeros(8, 16)}
    long = {"ids": torch.zeros(4, 40), "mask": torch.zeros(4, 40)}
    assert B.per_sample_numel(short) == 32
    assert B.per_sample_numel(long) == 80
