// Vocable web client: microphone -> WebRTC -> the agent; transcript, stage and latency on the page.
// No build step. URL parameters: ?raw=1 turns audio processing off (automated clients with a fake
// microphone), ?playbook=ID picks a playbook, ?token=T sends a bearer token, ?autocall=1 calls at load.
"use strict";

const params = new URLSearchParams(location.search);
const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), banner: $("banner"), call: $("call"), mute: $("mute"), level: $("level"),
  stage: $("stage"), transcript: $("transcript"), typed: $("typed"), text: $("text"),
  send: $("send"), metrics: $("metrics").querySelector("tbody"), remote: $("remote"),
  playbook: $("playbook"),
};

const METRIC_LABELS = {
  voice_to_voice_ms: "Voice to voice",
  end_of_speech_ms: "End of speech detected",
  stt_ms: "Speech to text",
  llm_first_token_ms: "LLM first token",
  first_sentence_ms: "First sentence ready",
  tts_first_audio_ms: "First audio synthesized",
  first_frame_out_ms: "First frame sent",
};

let config = null;
let call = null;          // {pc, channel, stream, sessionId, meter, timer}
let wantConnected = false;
let reconnectAttempts = 0;
let agentLine = null;     // the transcript line of the agent's current answer
let serverMetrics = null; // {event, arrived, turn}: the server's last turn_metrics
let speechEnd = null;     // the server's last speech_end event
// Each answer heard here: {heard_ms (graph + output device), graph_ms, output_latency_ms,
// server (the server's turn_metrics of the same turn, or null), speech_end (the server's last
// speech_end before it), onset_unix_ms and last_voiced_unix_ms (the answer's first audible and
// the caller's last voiced window on the wall clock, to compare with the server's times on the
// same machine)}. Read by automated clients.
const heardTurns = [];
window.vocable = { turns: heardTurns };
const PAIR_MS = 1500;     // the server's metrics and the page's answer onset of one turn

function setStatus(text) { ui.status.textContent = text; }

function showBanner(text, isError = false) {
  ui.banner.textContent = text;
  ui.banner.classList.toggle("error", isError);
  ui.banner.hidden = !text;
}

function addLine(kind, who, text) {
  const line = document.createElement("div");
  line.className = `line ${kind}`;
  if (who) {
    const label = document.createElement("span");
    label.className = "who";
    label.textContent = who;
    line.appendChild(label);
  }
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  line.appendChild(body);
  ui.transcript.appendChild(line);
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
  return line;
}

function appendAgent(text) {
  if (!agentLine) agentLine = addLine("agent", "Agent", text);
  else agentLine.querySelector(".text").textContent += " " + text;
}

function showMetrics(event) {
  ui.metrics.textContent = "";
  const heard = heardTurns.length ? heardTurns[heardTurns.length - 1] : null;
  const row = ui.metrics.insertRow();
  row.className = "heard";
  row.insertCell().textContent = "Voice to voice, heard here";
  const cell = row.insertCell();
  cell.className = "value";
  cell.id = "heard-ms";
  if (!heard) cell.textContent = "–";
  else {
    cell.textContent = `${Math.round(heard.heard_ms)} ms`;
    if (heard.output_latency_ms) cell.title = `including ${Math.round(heard.output_latency_ms)} ms of the output device`;
  }
  for (const [key, label] of Object.entries(METRIC_LABELS)) {
    const row = ui.metrics.insertRow();
    row.insertCell().textContent = label;
    const cell = row.insertCell();
    cell.className = "value";
    cell.textContent = event[key] == null ? "–" : `${Math.round(event[key])} ms`;
  }
}

function onEvent(event) {
  switch (event.type) {
    case "transcript":
      if (event.text) { addLine("user", "You", event.text); agentLine = null; }
      break;
    case "agent_sentence": appendAgent(event.text); break;
    case "tts_end": agentLine = null; break;
    case "interrupted":
      if (agentLine) agentLine.classList.add("interrupted");
      else if (event.heard === "") addLine("system", "", "(agent interrupted)");
      agentLine = null;
      break;
    case "stage_change": ui.stage.textContent = `Stage: ${event.name}`; break;
    case "tool_call_start": addLine("tool", "", `… ${event.name}`); break;
    case "tool_call_end": if (event.error) addLine("tool", "", `${event.name} failed`); break;
    case "turn_metrics": onServerMetrics(event); break;
    case "speech_end": speechEnd = event; break;
    case "state": if (call) setStatus(`In call — ${event.state}`); break;
    case "error": addLine("system", "", `Error (${event.source}): ${event.message}`); break;
    case "recording_failed": addLine("system", "", `Recording stopped: ${event.message}`); break;
    case "hangup": wantConnected = false; hangUp(`Call ended: ${event.reason}`); break;
  }
}

// The server's latency figures of a turn, paired with the page's own of the same turn: whichever
// of the two comes second, within PAIR_MS of the other.
function onServerMetrics(event) {
  const now = performance.now();
  const last = heardTurns[heardTurns.length - 1];
  serverMetrics = { event, arrived: now, turn: null };
  if (last && !last.server && now - last.at < PAIR_MS) { last.server = event; serverMetrics.turn = last; }
  showMetrics(event);
}

function onHeard(measured) {
  const context = call && call.timer ? call.timer.context : null;
  const output = context ? (context.outputLatency || 0) * 1000 : 0;
  const now = performance.now();
  // audio clock -> wall clock: the render clock is at context.currentTime now
  const unix = (at) => context ? performance.timeOrigin + now - (context.currentTime - at) * 1000 : null;
  const turn = {
    heard_ms: measured.voice_to_voice_ms + output, graph_ms: measured.voice_to_voice_ms,
    output_latency_ms: output, server: null, speech_end: speechEnd, at: now,
    onset_unix_ms: unix(measured.at), last_voiced_unix_ms: unix(measured.last_voiced_at),
  };
  if (serverMetrics && !serverMetrics.turn && turn.at - serverMetrics.arrived < PAIR_MS) {
    turn.server = serverMetrics.event;
    serverMetrics.turn = turn;
  }
  heardTurns.push(turn);
  showMetrics(serverMetrics ? serverMetrics.event : {});
}

// The voice-to-voice latency as this page hears it (voice-timer.js): the microphone's stream and
// the agent's, read together on the audio clock. Null where the browser has no AudioWorklet.
async function startVoiceTimer(stream) {
  const Context = window.AudioContext || window.webkitAudioContext;
  if (!Context || !window.AudioWorkletNode) return null;
  const context = new Context({ latencyHint: "interactive" });
  try {
    await context.audioWorklet.addModule("/client/voice-timer.js");
    const node = new AudioWorkletNode(context, "voice-timer", { numberOfInputs: 2, numberOfOutputs: 1 });
    context.createMediaStreamSource(stream).connect(node, 0, 0);
    const silent = context.createGain();
    silent.gain.value = 0;  // the node runs only when connected to the output; nothing is heard
    node.connect(silent).connect(context.destination);
    node.port.onmessage = (message) => { if (message.data.type === "turn") onHeard(message.data); };
    await context.resume();
    return {
      context,
      listen(remote) { context.createMediaStreamSource(remote).connect(node, 0, 1); },
      stop() { context.close(); },
    };
  } catch (error) {
    context.close();
    console.warn("voice-to-voice timing unavailable:", error);
    return null;
  }
}

function micErrorMessage(error) {
  switch (error && error.name) {
    case "NotAllowedError": case "SecurityError":
      return "Microphone permission was denied. Allow the microphone for this site and try again.";
    case "NotFoundError": case "OverconstrainedError":
      return "No microphone was found. Connect one and try again.";
    case "NotReadableError":
      return "The microphone is busy in another application.";
    default:
      return `Cannot use the microphone: ${error && error.message ? error.message : error}`;
  }
}

function startMeter(stream) {
  const Context = window.AudioContext || window.webkitAudioContext;
  if (!Context) return null;
  const context = new Context();
  const analyser = context.createAnalyser();
  analyser.fftSize = 512;
  context.createMediaStreamSource(stream).connect(analyser);
  const samples = new Float32Array(analyser.fftSize);
  let running = true;
  const tick = () => {
    if (!running) return;
    analyser.getFloatTimeDomainData(samples);
    let sum = 0;
    for (const s of samples) sum += s * s;
    const rms = Math.sqrt(sum / samples.length);
    ui.level.style.width = `${Math.min(100, rms * 400)}%`;
    requestAnimationFrame(tick);
  };
  tick();
  return { stop() { running = false; context.close(); ui.level.style.width = "0"; } };
}

function waitForIceGathering(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => { if (pc.iceGatheringState === "complete") { pc.removeEventListener("icegatheringstatechange", done); resolve(); } };
    pc.addEventListener("icegatheringstatechange", done);
    setTimeout(resolve, 3000);  // use what was gathered so far
  });
}

async function startCall() {
  wantConnected = true;
  showBanner(config && !config.llm_configured ? llmNotice(config.llm) : "");
  setStatus("Asking for the microphone…");
  const raw = params.get("raw") === "1";
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: !raw, noiseSuppression: !raw, autoGainControl: !raw },
    });
  } catch (error) {
    wantConnected = false;
    showBanner(micErrorMessage(error), true);
    setStatus("Ready");
    return;
  }
  setStatus("Connecting…");
  const pc = new RTCPeerConnection({ iceServers: (config && config.ice_servers) || [] });
  const channel = pc.createDataChannel("events");
  channel.onmessage = (message) => onEvent(JSON.parse(message.data));
  stream.getTracks().forEach((track) => pc.addTrack(track, stream));
  const timer = await startVoiceTimer(stream);
  pc.ontrack = (event) => {
    const remote = event.streams[0] || new MediaStream([event.track]);
    ui.remote.srcObject = remote;  // (Chromium feeds WebAudio a remote stream only while it plays)
    if (timer) timer.listen(remote);
  };
  call = { pc, channel, stream, sessionId: null, meter: startMeter(stream), timer };
  pc.onconnectionstatechange = () => {
    if (!call || call.pc !== pc) return;
    if (pc.connectionState === "connected") { reconnectAttempts = 0; setStatus("In call"); }
    if (pc.connectionState === "failed" || pc.connectionState === "disconnected") dropped();
  };
  ui.call.textContent = "Hang up";
  ui.call.classList.add("active");
  try {
    await pc.setLocalDescription(await pc.createOffer());
    await waitForIceGathering(pc);
    const headers = { "Content-Type": "application/json" };
    if (params.get("token")) headers.Authorization = `Bearer ${params.get("token")}`;
    const response = await fetch("/offer", {
      method: "POST", headers,
      body: JSON.stringify({ sdp: pc.localDescription.sdp, type: "offer", playbook: ui.playbook.value || undefined }),
    });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.error || `HTTP ${response.status}`);
    call.sessionId = answer.session_id;
    await pc.setRemoteDescription({ sdp: answer.sdp, type: "answer" });
    ui.mute.disabled = ui.text.disabled = ui.send.disabled = false;
  } catch (error) {
    wantConnected = false;
    hangUp();
    showBanner(`Could not start the call: ${error.message}`, true);
  }
}

function hangUp(message) {
  if (call) {
    try { if (call.channel.readyState === "open") call.channel.send(JSON.stringify({ type: "hangup" })); } catch (_) { /* closing anyway */ }
    call.stream.getTracks().forEach((track) => track.stop());
    if (call.meter) call.meter.stop();
    if (call.timer) call.timer.stop();
    call.pc.close();
    call = null;
  }
  agentLine = null;
  ui.call.textContent = "Call";
  ui.call.classList.remove("active");
  ui.mute.disabled = ui.text.disabled = ui.send.disabled = true;
  ui.mute.textContent = "Mute";
  setStatus(message || "Ready");
}

function dropped() {
  hangUp("Connection lost");
  if (wantConnected && reconnectAttempts < 3) {
    reconnectAttempts += 1;
    setStatus(`Connection lost — reconnecting (${reconnectAttempts}/3)…`);
    setTimeout(() => { if (wantConnected && !call) startCall(); }, 1500 * reconnectAttempts);
  } else if (wantConnected) {
    wantConnected = false;
    showBanner("The connection was lost. Press Call to try again.", true);
  }
}

ui.call.addEventListener("click", () => {
  if (call) { wantConnected = false; hangUp("Call ended"); } else startCall();
});

ui.mute.addEventListener("click", () => {
  if (!call) return;
  const muted = ui.mute.textContent === "Mute";
  call.stream.getAudioTracks().forEach((track) => { track.enabled = !muted; });
  if (call.channel.readyState === "open") call.channel.send(JSON.stringify({ type: "mute", muted }));
  ui.mute.textContent = muted ? "Unmute" : "Mute";
});

ui.typed.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.text.value.trim();
  if (!text || !call || call.channel.readyState !== "open") return;
  call.channel.send(JSON.stringify({ type: "text", text }));
  addLine("user", "You (typed)", text);
  agentLine = null;
  ui.text.value = "";
});

// What the server says of its LLM, while it has none ready: searching, downloading (with its
// progress, polled until it is over), unavailable (what failed and the ways out), or off.
function llmNotice(llm) {
  const ways = "start the server with --llm-gguf FILE, --llm-base-url URL (any OpenAI-compatible server) or --llm none";
  if (!llm || llm.state === "off") {
    return "No LLM on this server (--llm none): calls connect, and the agent says it cannot answer yet.";
  }
  if (llm.state === "downloading") {
    const percent = llm.progress == null ? "" : ` ${Math.floor(llm.progress * 100)} %`;
    return `Downloading the language model ${llm.model || ""} (once)…${percent}. Calls connect meanwhile; the agent answers once it is loaded.`;
  }
  if (llm.state === "loading" || llm.state === "searching") {
    return `Loading the language model ${llm.model || ""}…`;
  }
  if (llm.state === "unavailable") return `No language model: ${llm.detail}. To fix it, ${ways}.`;
  return "";
}

async function showLlmStatus() {
  if (config.llm_configured) {
    if (ui.banner.dataset.llm) showBanner("");
    delete ui.banner.dataset.llm;
    return;
  }
  showBanner(llmNotice(config.llm));
  ui.banner.dataset.llm = "1";
  const pending = config.llm && ["downloading", "loading", "searching"].includes(config.llm.state);
  if (pending) {
    setTimeout(async () => {
      try { config = await (await fetch("/config")).json(); } catch (error) { /* try again */ }
      showLlmStatus();
    }, 1000);
  }
}

async function init() {
  try {
    config = await (await fetch("/config")).json();
    const playbooks = await (await fetch("/playbooks")).json();
    for (const playbook of playbooks) {
      const option = new Option(playbook.name, playbook.id);
      option.title = playbook.description || "";
      ui.playbook.add(option);
    }
    ui.playbook.value = params.get("playbook") || config.default_playbook;
    showLlmStatus();
  } catch (error) {
    showBanner(`Cannot reach the Vocable server: ${error.message}`, true);
    return;
  }
  if (!window.RTCPeerConnection || !navigator.mediaDevices) {
    showBanner("This browser cannot make WebRTC calls (or the page is not served over HTTPS or localhost).", true);
    ui.call.disabled = true;
    return;
  }
  if (params.get("autocall") === "1") startCall();
}

init();
