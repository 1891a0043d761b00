import pytest

from tfmem_magic import TfmemUsageError, format_bytes, parse_size
from tfmem_magic.adapters.arguments import parse_cell_args


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512MB", 512 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("2G", 2 * 2**30),
        ("6gb", 6 * 10**9),
        ("100", 100),
        ("64 KiB", 64 * 1024),
        (".5M", 2**19),
        ("1t", 2**40),
    ],
)
def test_parse_size_accepts_common_spellings(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "12parsecs", "-1G", "1.2.3G", "0", "0MB"])
def test_parse_size_rejects_with_the_fix(text):
    with pytest.raises(TfmemUsageError, match="512MB|positive"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(812) == "812 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3 GiB"
    assert format_bytes(-2 * 2**20) == "-2 MiB"
    assert format_bytes(None) == "n/a"


def test_cell_args_defaults():
    args = parse_cell_args("")
    assert args.options.mode == "trace" and args.options.interval_ms == 50.0
    assert args.panel and args.as_name is None and args.save is None
    assert args.options.calibrate is None  # the session's setting (%tfmem calibrate on|off) decides
    assert parse_cell_args("--calibrate").options.calibrate is True
    assert parse_cell_args("--no-calibrate").options.calibrate is False


def test_cell_args_all_options(tmp_path):
    line = (
        f'--quick --limit 1.5GiB --as rep --label "my cell" --no-panel --save {tmp_path}/r.json '
        "--interval 5 --trace-steps 3 --trace-seconds 7"
    )
    args = parse_cell_args(line)
    o = args.options
    assert (o.mode, o.limit_bytes, o.label, o.interval_ms, o.trace_steps, o.trace_seconds) == (
        "quick",
        int(1.5 * 2**30),
        "my cell",
        5.0,
        3,
        7.0,
    )
    assert args.as_name == "rep" and not args.panel and args.save == tmp_path / "r.json"


@pytest.mark.parametrize(
    "line, fix",
    [
        ("--bogus", "unrecognized arguments"),
        ("--quick --trace", "not allowed with"),
        ("--calibrate --no-calibrate", "not allowed with"),
        ("--as 2bad", "not a Python name"),
        ("--as class", "not a Python name"),
        ("--limit lots", "512MB"),
        ("--save out.txt", ".json"),
        ("--save /no/such/dir/r.json", "does not exist"),
        ("--interval 0", "1 to 60000"),
        ("--interval fast", "invalid float"),
        ("--trace-steps 0", "at least 1"),
        ('--label "unclosed', "close your quotes"),
    ],
)
def test_bad_cell_args_name_the_fix(line, fix):
    with pytest.raises(TfmemUsageError, match=fix):
        parse_cell_args(line)
