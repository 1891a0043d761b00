from tfmem_magic.core.report import MIME_TYPE, DeviceMemory, EnvInfo, ErrorInfo, LiveGroup, Report, RssInfo, TraceInfo
from tfmem_magic.show.render import mime_bundle, render_html, render_text, verdict

EVIL = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'


def evil_report() -> Report:
    return Report(
        label=EVIL,
        status="error",
        error=ErrorInfo("ValueError", EVIL),
        env=EnvInfo(budget_bytes=10 * 2**30, ram_total_bytes=16 * 2**30, allocator="bfc_cpu_allocator_for_gpu"),
        rss=RssInfo(2**30, 2 * 2**30, 2**30, "hwm", [[t / 4, (1 + t / 4) * 2**30] for t in range(5)]),
        tf={"CPU:0": DeviceMemory(0, 3 * 2**20, 2**20)},
        trace=TraceInfo(
            events=2,
            peak_live_bytes=3 * 2**20,
            timeline=[[0, 0], [1, 3 * 2**20]],
            at_peak=[LiveGroup(op=EVIL, layer=EVIL, phase="forward", bytes=2**20, count=1, shape=EVIL)],
            by_layer=[LiveGroup(layer=EVIL, bytes=2**20)],
            by_phase=[LiveGroup(phase="forward", bytes=2**20)],
        ),
        notes=[EVIL],
    )


def test_html_escapes_every_user_string():
    html = render_html(evil_report())
    assert "<script>" not in html and "<img src=x" not in html and EVIL not in html
    assert "&lt;script&gt;" in html and "&lt;img src=x onerror=alert(2)&gt;" in html
    assert html.count("<img") == 1 and "data:image/png;base64," in html  # only our own timeline image


def test_a_cell_too_short_to_sample_draws_no_timeline():
    """A few sampling periods give no line worth reading (and the chart would be most of a short cell's cost): no
    image, and the panel's tab says why; from MIN_POINTS samples on, the chart is drawn."""
    from tfmem_magic.show import figures

    short = evil_report()
    short.trace = None
    short.wall_s = 0.03
    short.rss.samples = [[0.0, 2**30], [0.03, 2**30 + 4096]]
    assert figures.timeline_png(short) is None and "<img" not in render_html(short)
    short.rss.samples = [[t / 20, 2**30 + t * 4096] for t in range(figures.MIN_POINTS)]
    assert figures.timeline_png(short).startswith(b"\x89PNG")


def test_bundle_has_html_text_and_json():
    bundle = mime_bundle(evil_report())
    assert set(bundle) == {"text/plain", "text/html", MIME_TYPE}
    assert bundle[MIME_TYPE]["label"] == EVIL
    assert "TF " in bundle["text/plain"] and "3 MiB" in bundle["text/plain"]


def test_verdict_words():
    r = evil_report()
    r.status = "ok"
    assert verdict(r).startswith("fits with 8 GiB to spare")
    r.rss.peak_bytes = int(9.5 * 2**30)
    assert verdict(r) == "used 95% of the available RAM"
    r.rss.peak_bytes = 11 * 2**30
    assert verdict(r) == "over the available RAM by 1 GiB"
    r.status = "oom"
    assert verdict(r) == "ran out of memory"


def test_text_summary_mentions_error():
    assert "Error     ValueError" in render_text(evil_report())
