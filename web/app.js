// The demo page: one WebSocket session (/v1/audio/speech/ws) speaking turns into an AudioWorklet.
//
// Audio arrives as raw f32le binary frames at 24 kHz. Raw frames belong to "the turn that last
// started", so after Stop the page ignores binary frames until the next turn.started: audio of the
// cancelled turn that was already in flight never reaches the player. With an API key, open the page
// once as /?api_key=KEY: the server answers with a cookie that its later requests carry.
'use strict';

const SAMPLE_RATE = 24000;
const FRAMES_PER_SECOND = 12.5;           // one codec frame = 80 ms
const BUCKET = 480;                       // samples per waveform column bucket (20 ms)
const $ = (id) => document.getElementById(id);

// Test hooks and live numbers (read by tests/test_web.py).
const tts = window.__tts = {
  connected: false, session: null, settings: null, textMessages: 0, wsSamples: 0, turns: [],
  worklet: { received: 0, played: 0, buffered: 0, dropped: 0, underruns: 0, playing: false },
  errors: [],
};

let ws = null;
let wsReady = null;               // Promise resolved when the session is open
let audioCtx = null;
let player = null;
let turnSeq = 0;
const turns = new Map();          // turn_id -> turn record, until turn.done
let audioTurn = null;             // the turn that raw binary frames belong to, or null (drop them)
let lastTurn = null;              // for the waveform and the download
let tail = new Uint8Array(0);     // bytes of an incomplete f32 sample between frames
let settingsSent = null;          // JSON of the last session.update
let live = null;                  // {turnId, sent, queue} while a "speak as I type" turn is open
let liveIdle = null;
let downloadUrl = null;
let stopCount = 0;                // a turn still opening when Stop is pressed is not sent

function status(text, isError = false) {
  const el = $('status');
  el.textContent = text;
  el.classList.toggle('error', isError);
  if (isError) tts.errors.push(text);
}

// ---------------------------------------------------------------- audio output

async function ensureAudio() {
  if (!audioCtx) {
    audioCtx = new AudioContext({ sampleRate: SAMPLE_RATE, latencyHint: 'interactive' });
    await audioCtx.audioWorklet.addModule('player-worklet.js');
    player = new AudioWorkletNode(audioCtx, 'player', {
      numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1],
      processorOptions: { prebuffer: 960 },
    });
    player.port.onmessage = (e) => onPlayerStats(e.data);
    player.connect(audioCtx.destination);
  }
  if (audioCtx.state !== 'running') await audioCtx.resume();
}

function onPlayerStats(s) {
  Object.assign(tts.worklet, s);
  $('buffered').textContent = `${Math.round(s.buffered / SAMPLE_RATE * 1000)} ms`;
  $('underruns').textContent = s.underruns;
  $('level').style.width = `${Math.min(100, Math.sqrt(s.rms) * 140)}%`;
}

// ---------------------------------------------------------------- session

function wsUrl() {
  const url = new URL('v1/audio/speech/ws', location.href);
  url.protocol = location.protocol === 'https:' ? 'wss:' : 'ws:';
  return url.href;
}

function connect() {
  if (wsReady) return wsReady;
  wsReady = new Promise((resolve, reject) => {
    ws = new WebSocket(wsUrl());
    ws.binaryType = 'arraybuffer';
    settingsSent = null;
    ws.onmessage = (e) => {
      if (typeof e.data === 'string') {
        const msg = JSON.parse(e.data);
        if (msg.type === 'session.created') {
          tts.connected = true;
          tts.session = msg;
          $('conn').textContent = 'connected';
          $('conn').classList.add('open');
          resolve();
        }
        onControl(msg);
      } else {
        onAudio(e.data);
      }
    };
    ws.onclose = (e) => {
      tts.connected = false;
      $('conn').textContent = 'offline';
      $('conn').classList.remove('open');
      for (const turn of turns.values()) finishTurn(turn, { reason: 'closed' });
      wsReady = null;
      audioTurn = null;
      live = null;
      if (e.code !== 1000) status(`session closed (${e.code}${e.reason ? ': ' + e.reason : ''})`, e.code !== 1001);
      reject(new Error('session closed'));
    };
  });
  wsReady.catch(() => {});
  return wsReady;
}

function send(msg) {
  ws.send(JSON.stringify(msg));
  if (msg.type === 'text') tts.textMessages += 1;
}

// Voice, language and options go in a session.update, which the protocol allows between turns.
// Empty option fields mean the server's defaults (as session.created described them).
function sendSettings() {
  const defaults = (tts.session && tts.session.sampling) || {};
  const number = (id, fallback) => ($(id).value === '' ? fallback : Number($(id).value));
  const maxSeconds = number('max-seconds', null);
  const update = {
    type: 'session.update',
    format: { encoding: 'f32le', sample_rate: SAMPLE_RATE },
    audio_framing: 'raw',
    language: $('language').value,
    voice: $('voice').value || 'default',
    max_frames: maxSeconds === null ? null : Math.max(1, Math.ceil(maxSeconds * FRAMES_PER_SECOND)),
    sampling: { temperature: number('temperature', defaults.temperature ?? null), seed: number('seed', null) },
  };
  const json = JSON.stringify(update);
  if (json !== settingsSent) {
    ws.send(json);
    settingsSent = json;
  }
}

async function startTurn(text, final) {
  const stops = stopCount;
  await ensureAudio();
  await connect();
  if (stops !== stopCount) return null;
  if (turns.size === 0) sendSettings();
  const turn = {
    id: `t${++turnSeq}`, sentAt: performance.now(), firstAudioAt: null, samples: 0, chunks: [],
    pushedBefore: 0, peaks: [], bucketPeak: 0, bucketFill: 0, done: null,
  };
  turns.set(turn.id, turn);
  lastTurn = turn;
  send({ type: 'text', turn_id: turn.id, text, final });
  $('turn-state').textContent = 'waiting';
  $('ttfa').textContent = '…';
  $('rtf').textContent = '…';
  $('audio-s').textContent = '0.00 s';
  return turn;
}

function onControl(msg) {
  if (msg.type === 'session.updated') {
    tts.settings = msg;
  } else if (msg.type === 'turn.started') {
    audioTurn = turns.get(msg.turn_id) || null;
    tail = new Uint8Array(0);
    if (audioTurn) $('turn-state').textContent = 'speaking';
  } else if (msg.type === 'turn.done') {
    const turn = turns.get(msg.turn_id);
    if (turn) finishTurn(turn, msg);
  } else if (msg.type === 'error' && msg.code === 'fatal.idle_timeout') {
    status('The session closed while idle; the next turn opens a new one.');
  } else if (msg.type === 'error') {
    status(`server error ${msg.code}: ${msg.message}`, true);
    if (msg.turn_id && turns.has(msg.turn_id) && /fatal/.test(msg.code || '')) finishTurn(turns.get(msg.turn_id), { reason: 'error' });
  }
}

function onAudio(buffer) {
  const turn = audioTurn;
  if (!turn || turn.done) return;
  let bytes = new Uint8Array(buffer);
  if (tail.length) {
    const joined = new Uint8Array(tail.length + bytes.length);
    joined.set(tail);
    joined.set(bytes, tail.length);
    bytes = joined;
  }
  const whole = bytes.length - (bytes.length % 4);
  tail = bytes.slice(whole);
  if (!whole) return;
  const samples = new Float32Array(bytes.slice(0, whole).buffer);
  if (turn.firstAudioAt === null) {
    turn.firstAudioAt = performance.now();
    turn.pushedBefore = tts.wsSamples;
    $('ttfa').textContent = `${Math.round(turn.firstAudioAt - turn.sentAt)} ms`;
  }
  turn.chunks.push(samples);
  turn.samples += samples.length;
  tts.wsSamples += samples.length;
  addPeaks(turn, samples);
  player.port.postMessage({ type: 'push', samples });
  const seconds = turn.samples / SAMPLE_RATE;
  $('audio-s').textContent = `${seconds.toFixed(2)} s`;
  $('rtf').textContent = `${(seconds / ((performance.now() - turn.sentAt) / 1000)).toFixed(2)}×`;
}

function finishTurn(turn, done) {
  if (turn.done) return;
  turn.done = done;
  turns.delete(turn.id);
  if (audioTurn === turn) audioTurn = null;
  if (player) player.port.postMessage({ type: 'end' });
  const record = {
    id: turn.id, reason: done.reason, frames: done.frames, audio_ms: done.audio_ms, server_samples: done.samples,
    samples: turn.samples, ttfa_ms: turn.firstAudioAt === null ? null : turn.firstAudioAt - turn.sentAt,
    server_ttfa_ms: done.ttfa_ms, rtf: done.rtf,
  };
  tts.turns.push(record);
  addHistory(record);
  $('turn-state').textContent = done.reason || 'done';
  if (typeof done.rtf === 'number') $('rtf').textContent = `${done.rtf.toFixed(2)}×`;
  if (turn.samples) offerDownload(turn);
}

function addHistory(r) {
  const row = document.createElement('tr');
  const cells = [r.id, r.reason, `${(r.samples / SAMPLE_RATE).toFixed(2)} s`,
    r.ttfa_ms === null ? '–' : `${Math.round(r.ttfa_ms)} ms`, typeof r.rtf === 'number' ? `${r.rtf.toFixed(2)}×` : '–'];
  for (const text of cells) row.insertCell().textContent = text;
  const body = $('history');
  body.prepend(row);
  while (body.rows.length > 5) body.deleteRow(-1);
}

// ---------------------------------------------------------------- controls

async function speak() {
  const text = $('text').value.trim();
  if ($('live').checked) return endLiveTurn();
  if (!text) return;
  try {
    await startTurn(text, true);
    status('');
  } catch (err) {
    status(`could not speak: ${err.message}`, true);
  }
}

function stop() {
  if (ws && ws.readyState === WebSocket.OPEN) send({ type: 'cancel' });
  stopCount += 1;
  audioTurn = null;
  live = null;
  if (player) player.port.postMessage({ type: 'clear' });
  $('turn-state').textContent = 'stopped';
}

// "Speak as I type": whole words go out as they are typed; Enter (or the button) ends the turn.
// Pieces are recorded as sent synchronously, so input events arriving while the turn is still
// being opened neither repeat nor lose text; they wait in `queue` until the turn exists.
function onType() {
  if (!$('live').checked) return;
  clearTimeout(liveIdle);
  const value = $('text').value;
  if (live && !value.startsWith(live.sent)) live.sent = value.slice(0, live.sent.length);
  const pending = value.slice(live ? live.sent.length : 0);
  const cut = Math.max(pending.lastIndexOf(' '), pending.lastIndexOf('\n')) + 1;
  if (cut > 0 && pending.slice(0, cut).trim()) sendLive(pending.slice(0, cut), false);
  liveIdle = setTimeout(() => {
    const rest = $('text').value.slice(live ? live.sent.length : 0);
    if ($('live').checked && rest.trim()) sendLive(rest, false);
  }, 1200);
}

function sendLive(piece, final) {
  if (!live) {
    const opening = live = { turnId: null, sent: piece, queue: [] };
    startTurn(piece, final).then((turn) => {
      if (!turn) return;
      opening.turnId = turn.id;
      opening.queue.forEach(([p, f]) => send({ type: 'text', turn_id: turn.id, text: p, final: f }));
    }).catch((err) => status(`could not speak: ${err.message}`, true));
  } else {
    live.sent += piece;
    if (live.turnId) send({ type: 'text', turn_id: live.turnId, text: piece, final });
    else live.queue.push([piece, final]);
  }
  if (final) live = null;
}

function endLiveTurn() {
  clearTimeout(liveIdle);
  const pending = $('text').value.slice(live ? live.sent.length : 0);
  if (live || pending.trim()) sendLive(pending, true);
  $('text').value = '';
}

function onLiveToggle() {
  const on = $('live').checked;
  $('speak').textContent = on ? 'End turn' : 'Speak';
  $('hint').textContent = on
    ? 'Words are sent as you type them; Enter ends the turn. Stop cancels (barge-in).'
    : 'Speak sends the whole text as one turn. Stop cancels (barge-in) and empties the buffer.';
  if (on) $('text').focus();
}

// ---------------------------------------------------------------- waveform and download

function addPeaks(turn, samples) {
  for (let i = 0; i < samples.length; i++) {
    const v = Math.abs(samples[i]);
    if (v > turn.bucketPeak) turn.bucketPeak = v;
    if (++turn.bucketFill === BUCKET) {
      turn.peaks.push(turn.bucketPeak);
      turn.bucketPeak = 0;
      turn.bucketFill = 0;
    }
  }
}

function drawWave() {
  const canvas = $('wave');
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth * dpr, h = canvas.clientHeight * dpr;
  if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
  const g = canvas.getContext('2d');
  g.clearRect(0, 0, w, h);
  g.fillStyle = '#1f2a3d';
  g.fillRect(0, h / 2, w, 1);
  const turn = lastTurn;
  if (turn && turn.peaks.length) {
    const buckets = Math.max(turn.peaks.length, 5 * SAMPLE_RATE / BUCKET);
    const per = buckets / w;
    const played = (tts.worklet.played + tts.worklet.dropped - turn.pushedBefore) / BUCKET;
    for (let x = 0; x < w; x++) {
      const from = Math.floor(x * per), to = Math.min(turn.peaks.length, Math.max(from + 1, Math.floor((x + 1) * per)));
      if (from >= turn.peaks.length) break;
      let p = 0;
      for (let i = from; i < to; i++) if (turn.peaks[i] > p) p = turn.peaks[i];
      const bar = Math.max(1, p * h * 0.9);
      g.fillStyle = from < played ? '#6ea0ff' : '#3a4a66';
      g.fillRect(x, (h - bar) / 2, 1, bar);
    }
  }
  requestAnimationFrame(drawWave);
}

function wavBlob(chunks, total) {
  const data = new DataView(new ArrayBuffer(44 + total * 2));
  const text = (at, s) => { for (let i = 0; i < s.length; i++) data.setUint8(at + i, s.charCodeAt(i)); };
  text(0, 'RIFF'); data.setUint32(4, 36 + total * 2, true); text(8, 'WAVE');
  text(12, 'fmt '); data.setUint32(16, 16, true); data.setUint16(20, 1, true); data.setUint16(22, 1, true);
  data.setUint32(24, SAMPLE_RATE, true); data.setUint32(28, SAMPLE_RATE * 2, true);
  data.setUint16(32, 2, true); data.setUint16(34, 16, true);
  text(36, 'data'); data.setUint32(40, total * 2, true);
  let at = 44;
  for (const chunk of chunks) {
    for (let i = 0; i < chunk.length; i++, at += 2) {
      const v = Math.max(-1, Math.min(1, chunk[i]));
      data.setInt16(at, v < 0 ? v * 0x8000 : v * 0x7fff, true);
    }
  }
  return new Blob([data], { type: 'audio/wav' });
}

function offerDownload(turn) {
  if (downloadUrl) URL.revokeObjectURL(downloadUrl);
  downloadUrl = URL.createObjectURL(wavBlob(turn.chunks, turn.samples));
  const a = $('download');
  a.href = downloadUrl;
  a.download = `${turn.id}.wav`;
  a.classList.remove('disabled');
  a.removeAttribute('aria-disabled');
}

// ---------------------------------------------------------------- reference voice

let refWav = null;                // base64 WAV of the loaded or recorded reference
let recorder = null;

async function loadReference(blob) {
  await ensureAudio();
  const decoded = await audioCtx.decodeAudioData(await blob.arrayBuffer());  // resampled to 24 kHz
  const mono = new Float32Array(decoded.length);
  for (let c = 0; c < decoded.numberOfChannels; c++) {
    const ch = decoded.getChannelData(c);
    for (let i = 0; i < mono.length; i++) mono[i] += ch[i] / decoded.numberOfChannels;
  }
  const wav = wavBlob([mono], mono.length);
  refWav = await blobBase64(wav);
  $('ref-preview').src = URL.createObjectURL(wav);
  $('ref-preview').hidden = false;
  $('ref-info').textContent = `${(mono.length / SAMPLE_RATE).toFixed(1)} s`;
  $('save-voice').disabled = false;
}

function blobBase64(blob) {
  return new Promise((resolve) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result.split(',')[1]);
    reader.readAsDataURL(blob);
  });
}

async function toggleRecord() {
  if (recorder) { recorder.stop(); return; }
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const parts = [];
    recorder = new MediaRecorder(stream);
    recorder.ondataavailable = (e) => parts.push(e.data);
    recorder.onstop = async () => {
      stream.getTracks().forEach((t) => t.stop());
      recorder = null;
      $('record').textContent = '● Record';
      $('record').classList.remove('recording');
      await loadReference(new Blob(parts, { type: parts[0]?.type }));
    };
    recorder.start();
    $('record').textContent = '■ Stop recording';
    $('record').classList.add('recording');
  } catch (err) {
    status(`cannot record: ${err.message}`, true);
  }
}

async function saveVoice() {
  const body = { audio: refWav };
  if ($('ref-text').value.trim() && !$('ref-xvec').checked) body.ref_text = $('ref-text').value.trim();
  if ($('ref-name').value.trim()) body.name = $('ref-name').value.trim();
  $('save-voice').disabled = true;
  status('computing the voice…');
  try {
    const res = await fetch('v1/voices', { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
    const out = await res.json();
    if (!res.ok) throw new Error(out.error ? out.error.message : res.statusText);
    await loadVoices(out.voice_id);
    status(`voice ${out.voice_id} saved (${out.mode}, ${out.duration_s.toFixed(1)} s)`);
  } catch (err) {
    status(`could not save the voice: ${err.message}`, true);
  } finally {
    $('save-voice').disabled = false;
  }
}

async function loadVoices(select) {
  const res = await fetch('v1/voices');
  if (!res.ok) return;
  const body = await res.json();
  const list = Array.isArray(body) ? body : body.voices || body.data || [];
  const picker = $('voice');
  const keep = select ?? picker.value;
  picker.length = 1;
  for (const v of list) {
    const id = v.voice_id || v.id;
    picker.add(new Option(v.name && v.name !== id ? `${v.name} (${v.mode || id})` : id, id));
  }
  picker.value = [...picker.options].some((o) => o.value === keep) ? keep : '';
}

// ---------------------------------------------------------------- start

async function init() {
  $('speak').onclick = speak;
  $('stop').onclick = stop;
  $('live').onchange = onLiveToggle;
  $('text').addEventListener('input', onType);
  $('text').addEventListener('keydown', (e) => {
    if ($('live').checked && e.key === 'Enter' && !e.shiftKey) { e.preventDefault(); endLiveTurn(); }
  });
  $('ref-file').onchange = (e) => e.target.files[0] && loadReference(e.target.files[0]).catch((err) => status(`cannot read that audio: ${err.message}`, true));
  $('record').onclick = toggleRecord;
  $('save-voice').onclick = saveVoice;
  if (!navigator.mediaDevices || !window.MediaRecorder) $('record').disabled = true;
  requestAnimationFrame(drawWave);
  try {
    const health = await (await fetch('health')).json();
    $('model').textContent = health.model || 'model';
    if (health.demo === true) {
      if (health.notice) $('demo-banner').textContent = `${health.notice[0].toUpperCase()}${health.notice.slice(1)}.`;
      $('demo-banner').hidden = false;
    }
    await loadVoices();
  } catch (err) {
    status(`server not reachable: ${err.message}`, true);
  }
  connect().catch(() => {});
}

init();
