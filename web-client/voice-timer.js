// Vocable web client: the voice-to-voice latency this browser hears, measured on the audio clock.
//
// An AudioWorklet with two inputs: 0, the microphone as captured; 1, the agent's audio as played
// out (after WebRTC's jitter buffer and decoder). Both are read in the same render quantum, so
// their times compare exactly. Every 5 ms window gets a level (RMS, dBFS):
// - the caller is voiced in a window louder than max(-50 dBFS, the microphone's noise floor +
//   15 dB); the end of the caller's speech is the end of the last voiced window;
// - the agent is audible in a window no more than 20 dB below its own speech level: the median
//   level of the agent's windows louder than -50 dBFS so far (-30 dBFS before any), so that a
//   quiet lead-in, or comfort noise, is not the answer;
// - an answer starts when the agent becomes audible after 300 ms without being audible. If the
//   caller spoke since the previous answer started, the worklet posts
//   {type: "turn", voice_to_voice_ms, at, last_voiced_at}: from the caller's last voiced window
//   (ending at ``last_voiced_at``, seconds on the audio clock) to that start (``at``).
// The page adds the output device's latency (AudioContext.outputLatency) where reported.
"use strict";

const WINDOW_S = 0.005;
const FLOOR_DBFS = -50;
const MIC_MARGIN_DB = 15;
const AUDIBLE_BELOW_SPEECH_DB = 20;
const ANSWER_GAP_S = 0.3;
const DEFAULT_SPEECH_DBFS = -30;

class LevelWindow {
  constructor(size) { this.size = size; this.sum = 0; this.count = 0; }
  // Adds samples; returns the dBFS of each window completed, with its end offset in the block.
  add(samples) {
    const done = [];
    for (let i = 0; i < samples.length; i++) {
      this.sum += samples[i] * samples[i];
      this.count += 1;
      if (this.count === this.size) {
        const rms = Math.sqrt(this.sum / this.size);
        done.push([rms > 0 ? 20 * Math.log10(rms) : -Infinity, i + 1]);
        this.sum = 0;
        this.count = 0;
      }
    }
    return done;
  }
}

class VoiceTimer extends AudioWorkletProcessor {
  constructor() {
    super();
    const size = Math.round(sampleRate * WINDOW_S);
    this.mic = new LevelWindow(size);
    this.agent = new LevelWindow(size);
    this.noiseFloor = -Infinity;
    this.lastVoicedAt = null;
    this.lastAudibleAt = -Infinity;
    this.answerStartedAt = -Infinity;
    this.histogram = new Uint32Array(121);  // agent windows by level, 1 dB bins from -120 dBFS
    this.histogramCount = 0;
  }

  speechLevel() {
    if (this.histogramCount === 0) return DEFAULT_SPEECH_DBFS;
    let seen = 0;
    for (let bin = 0; bin < this.histogram.length; bin++) {
      seen += this.histogram[bin];
      if (seen * 2 >= this.histogramCount) return bin - 120;
    }
    return DEFAULT_SPEECH_DBFS;
  }

  onMic(dbfs, at) {
    // the floor follows quiet windows down at once and up slowly (1 dB a second)
    if (dbfs < this.noiseFloor) this.noiseFloor = dbfs;
    else this.noiseFloor += WINDOW_S;
    if (dbfs > Math.max(FLOOR_DBFS, this.noiseFloor + MIC_MARGIN_DB)) this.lastVoicedAt = at;
  }

  onAgent(dbfs, at) {
    if (dbfs > FLOOR_DBFS) {
      this.histogram[Math.min(120, Math.max(0, Math.round(dbfs) + 120))] += 1;
      this.histogramCount += 1;
    }
    if (dbfs < this.speechLevel() - AUDIBLE_BELOW_SPEECH_DB) return;
    const windowStart = at - WINDOW_S;
    if (windowStart - this.lastAudibleAt >= ANSWER_GAP_S) {
      const spoke = this.lastVoicedAt !== null && this.lastVoicedAt > this.answerStartedAt;
      if (spoke) {
        const ms = (windowStart - this.lastVoicedAt) * 1000;
        this.port.postMessage({
          type: "turn", voice_to_voice_ms: ms, at: windowStart, last_voiced_at: this.lastVoicedAt,
        });
      }
      this.answerStartedAt = windowStart;
    }
    this.lastAudibleAt = at;
  }

  process(inputs) {
    const blockStart = currentFrame / sampleRate;
    const channel = (input) => (input && input.length ? input[0] : null);
    const mic = channel(inputs[0]);
    const agent = channel(inputs[1]);
    if (mic) for (const [dbfs, end] of this.mic.add(mic)) this.onMic(dbfs, blockStart + end / sampleRate);
    if (agent) for (const [dbfs, end] of this.agent.add(agent)) this.onAgent(dbfs, blockStart + end / sampleRate);
    return true;
  }
}

registerProcessor("voice-timer", VoiceTimer);
