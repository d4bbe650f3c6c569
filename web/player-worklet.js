// Gapless playback of streamed 24 kHz mono audio.
//
// The page pushes float32 chunks as they arrive over the WebSocket; the audio thread plays them from
// a ring buffer. The ring grows instead of dropping audio, because the server may produce much faster
// than real time and the page must keep reading its socket (the server closes slow readers).
// Playback starts once `prebuffer` samples are queued (or the turn has ended), and after an underrun
// waits for `prebuffer` again, so network jitter costs one short pause rather than clicks.

class PlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.ring = new Float32Array(opts.capacity || 24000 * 30);
    this.prebuffer = opts.prebuffer ?? 960;
    this.readAt = 0;
    this.size = 0;            // samples queued
    this.playing = false;
    this.ended = true;        // no more audio is expected for now: play out what is queued
    this.received = 0;
    this.played = 0;
    this.dropped = 0;
    this.underruns = 0;
    this.peak = 0;
    this.sumSquares = 0;
    this.levelSamples = 0;
    this.quanta = 0;
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  onMessage(msg) {
    if (msg.type === 'push') {
      this.push(msg.samples);
      this.ended = false;
    } else if (msg.type === 'end') {
      this.ended = true;
    } else if (msg.type === 'clear') {
      this.dropped += this.size;
      this.size = 0;
      this.playing = false;
      this.ended = true;
    }
    this.report();
  }

  push(samples) {
    if (this.size + samples.length > this.ring.length) {
      let capacity = this.ring.length * 2;
      while (capacity < this.size + samples.length) capacity *= 2;
      const grown = new Float32Array(capacity);
      grown.set(this.take(this.size, true));
      this.ring = grown;
      this.readAt = 0;
    }
    const cap = this.ring.length;
    const writeAt = (this.readAt + this.size) % cap;
    const first = Math.min(samples.length, cap - writeAt);
    this.ring.set(samples.subarray(0, first), writeAt);
    this.ring.set(samples.subarray(first), 0);
    this.size += samples.length;
    this.received += samples.length;
  }

  // The next n queued samples as one array (a copy); `peek` leaves them queued.
  take(n, peek = false) {
    const cap = this.ring.length;
    const out = new Float32Array(n);
    const first = Math.min(n, cap - this.readAt);
    out.set(this.ring.subarray(this.readAt, this.readAt + first));
    out.set(this.ring.subarray(0, n - first), first);
    if (!peek) {
      this.readAt = (this.readAt + n) % cap;
      this.size -= n;
    }
    return out;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing && this.size > 0 && (this.size >= this.prebuffer || this.ended)) this.playing = true;
    let n = 0;
    if (this.playing) {
      n = Math.min(out.length, this.size);
      out.set(this.take(n));
      this.played += n;
      if (this.size === 0) {
        if (!this.ended) this.underruns += 1;
        this.playing = false;
      }
    }
    out.fill(0, n);
    for (let i = 0; i < n; i++) {
      const v = out[i];
      this.sumSquares += v * v;
      if (Math.abs(v) > this.peak) this.peak = Math.abs(v);
    }
    this.levelSamples += out.length;
    if (++this.quanta % 8 === 0) this.report();
    return true;
  }

  report() {
    const rms = this.levelSamples ? Math.sqrt(this.sumSquares / this.levelSamples) : 0;
    this.port.postMessage({
      type: 'stats', received: this.received, played: this.played, buffered: this.size,
      dropped: this.dropped, underruns: this.underruns, playing: this.playing, peak: this.peak, rms,
    });
    this.peak = 0;
    this.sumSquares = 0;
    this.levelSamples = 0;
  }
}

registerProcessor('player', PlayerProcessor);
