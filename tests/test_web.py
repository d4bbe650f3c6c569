"""The demo page in real headless Chromium (Debian's /usr/bin/chromium) against the real server.

The page's test hooks (`window.__tts`) expose what its AudioWorklet player counted, so the tests
check sample counts end to end: socket -> worklet ring buffer -> audio output. A screenshot is
saved as test-artifacts/web-demo.png.
"""
from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from tts_server import REPO, tts_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = REPO / "test-artifacts"
SAMPLES_PER_FRAME = 1920
API_KEY = "sesame"
LONG_TEXT = ("This turn is long on purpose, so that the stop button has something to interrupt. ") * 6


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # The tiny random model never says EOS: every turn runs to its max_frames, which the page's
    # "Max length" option sets per turn; the server's cap stops a turn whose stop button failed.
    # It also runs behind an API key: a page opened once as /?api_key=KEY gets a cookie from the
    # server that its files, REST calls and WebSocket then carry.
    voices = tmp_path_factory.mktemp("voices")
    with tts_server(tiny_model_dir, "--max-frames", "400", "--voices-dir", str(voices), api_key=API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), "Debian's chromium package is needed (apt-get install chromium)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--autoplay-policy=no-user-gesture-required"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    page = browser.new_page(viewport={"width": 1200, "height": 820})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server}/?api_key={API_KEY}")
    page.wait_for_function("window.__tts && window.__tts.connected", timeout=15000)
    yield page
    errors += page.evaluate("window.__tts.errors")      # what the page showed as errors
    page.close()
    assert not errors, errors
    foreign = [u for u in requests if not u.startswith((server, server.replace("http", "ws"), "data:", "blob:"))]
    assert not foreign, f"the page must work offline, but it fetched {foreign}"


def set_max_seconds(page, seconds: str) -> None:
    if not page.is_visible("#max-seconds"):
        page.click(".options summary")
    page.fill("#max-seconds", seconds)


def done_turn(page, index: int, timeout_ms: int = 60000) -> dict:
    page.wait_for_function(f"window.__tts.turns.length > {index}", timeout=timeout_ms)
    return page.evaluate(f"window.__tts.turns[{index}]")


def test_page_speaks_a_sentence_into_the_worklet(page):
    set_max_seconds(page, "1")
    page.fill("#text", "Hello from the browser test.")
    page.click("#speak")
    turn = done_turn(page, 0)
    assert turn["reason"] in ("eos", "max_frames")
    assert turn["frames"] == 13                 # ceil(1 s x 12.5 frames/s)
    assert turn["samples"] == turn["server_samples"] == turn["frames"] * SAMPLES_PER_FRAME
    page.wait_for_function(f"window.__tts.worklet.received === {turn['samples']}", timeout=5000)
    assert turn["ttfa_ms"] is not None and 0 < turn["ttfa_ms"] < 30000
    assert page.text_content("#ttfa").endswith("ms") and page.text_content("#rtf").endswith("×")

    # The worklet plays it out in real time, gaplessly (no underrun once playback started).
    page.wait_for_function(f"window.__tts.worklet.played === {turn['samples']}",
                           timeout=int(turn["audio_ms"]) + 10000)
    assert page.evaluate("window.__tts.worklet.buffered") == 0

    # The last turn as a WAV download: 16-bit mono 24 kHz with every sample.
    wav = base64.b64decode(page.evaluate("""async () => {
        const blob = await (await fetch(document.querySelector('#download').href)).blob();
        const bytes = new Uint8Array(await blob.arrayBuffer());
        let s = ''; for (const b of bytes) s += String.fromCharCode(b); return btoa(s); }"""))
    assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE"
    assert int.from_bytes(wav[24:28], "little") == 24000 and len(wav) == 44 + 2 * turn["samples"]

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web-demo.png"))


def test_stop_cancels_a_long_turn_and_empties_the_buffer(page):
    page.fill("#text", LONG_TEXT)
    page.click("#speak")
    page.wait_for_function(f"window.__tts.worklet.received >= {4 * SAMPLES_PER_FRAME}", timeout=60000)
    page.click("#stop")
    turn = done_turn(page, 0, timeout_ms=10000)
    assert turn["reason"] == "cancelled"
    page.wait_for_function("window.__tts.worklet.buffered === 0", timeout=2000)
    received = page.evaluate("window.__tts.worklet.received")
    page.wait_for_timeout(500)
    assert page.evaluate("window.__tts.worklet.received") == received, "audio kept arriving after stop"
    assert page.evaluate("window.__tts.worklet.played + window.__tts.worklet.dropped") == received

    # The session goes on: the next turn plays whole.
    set_max_seconds(page, "0.5")
    page.fill("#text", "And now a short one.")
    page.click("#speak")
    turn = done_turn(page, 1)
    assert turn["reason"] in ("eos", "max_frames") and turn["samples"] == turn["server_samples"] > 0
    page.wait_for_function(f"window.__tts.worklet.received === {received + turn['samples']}", timeout=5000)


def test_speak_as_i_type_sends_words_as_they_are_typed(page):
    set_max_seconds(page, "1")
    page.check("#live")
    page.fill("#text", "")
    page.click("#text")
    page.keyboard.type("one two three four ", delay=40)
    page.wait_for_function("window.__tts.textMessages >= 3", timeout=5000)
    page.keyboard.press("Enter")
    turn = done_turn(page, 0)
    assert turn["reason"] in ("eos", "max_frames")
    assert turn["samples"] == turn["server_samples"] == turn["frames"] * SAMPLES_PER_FRAME > 0
    assert page.input_value("#text") == ""


def test_reference_voice_is_saved_and_spoken_with(page, golden_dir):
    page.set_input_files("#ref-file", str(golden_dir / "cases" / "ref_en.wav"))
    page.wait_for_function("!document.querySelector('#save-voice').disabled", timeout=10000)
    page.fill("#ref-text", "The birch canoe slid on the smooth planks.")
    page.fill("#ref-name", "birch")
    page.click("#save-voice")
    page.wait_for_function("document.querySelector('#voice').selectedOptions[0].text.startsWith('birch')",
                           timeout=30000)
    voice_id = page.input_value("#voice")
    assert voice_id and "icl" in page.text_content("#status")

    set_max_seconds(page, "0.5")
    page.fill("#text", "Now in the cloned voice.")
    page.click("#speak")
    turn = done_turn(page, 0)
    assert turn["reason"] == "max_frames" and turn["samples"] == turn["server_samples"] > 0
    assert page.evaluate("window.__tts.settings.voice") == voice_id    # the session.updated it was spoken with


def test_page_needs_the_api_key(browser, server):
    page = browser.new_page()
    try:
        assert page.goto(server + "/").status == 401
    finally:
        page.close()
