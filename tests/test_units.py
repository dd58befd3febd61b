import pytest

from autotune.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * 1024**3),
        ("512MB", 512 * 1000**2),
        ("1.5G", int(1.5 * 1024**3)),
        ("4096", 4096),
        ("2 mib", 2 * 1024**2),
        ("1TB", 10**12),
        (".5KiB", 512),
        (123, 123),
    ],
    ids=str,
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "12XB", "GiB", "1.2.3G", "-1G", ""], ids=repr)
def test_parse_bytes_rejects_unreadable_sizes(text):
    with pytest.raises(ValueError, match="Invalid memory size"):
        parse_bytes(text)


@pytest.mark.parametrize("value", [0, -5, "0GiB"], ids=repr)
def test_parse_bytes_rejects_non_positive(value):
    with pytest.raises(ValueError, match="more than 0 bytes"):
        parse_bytes(value)


@pytest.mark.parametrize("value", [1.5, None, True, [1]], ids=repr)
def test_parse_bytes_rejects_other_types(value):
    with pytest.raises(TypeError, match="give bytes as an int or a string"):
        parse_bytes(value)


@pytest.mark.parametrize(
    "n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 * 2**30 + 2**29, "3.50 GiB"), (2**41, "2.00 TiB")]
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text
