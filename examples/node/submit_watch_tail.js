#!/usr/bin/env node
// Submits a job to dlsched's JobManagerService, follows WatchJobs for it until
// it ends and tails StreamJobLogs (follow) until that stream ends OK. Prints one
// JSON object per line on stdout, one per event:
//
//   {"event":"submitted","job":"jobs/x","state":"JOB_STATE_PENDING",...}
//   {"event":"watch","type":"WATCH_EVENT_TYPE_UPDATED","job":"jobs/x","state":...,"resumeToken":...}
//   {"event":"log","role":"main","replicaIndex":0,"stream":"LOG_STREAM_STDOUT","time":...,"text":...}
//   {"event":"logs_end","job":"jobs/x"}
//   {"event":"done","job":"jobs/x","state":"JOB_STATE_SUCCEEDED",...}
//
// Failures print {"event":"error",...} on stderr. Exit status: 0 when the job
// SUCCEEDED, 1 when it ended otherwise, 2 on a usage or RPC error.
//
// The client is generated at run time from protos/dlsched/v1 by
// @grpc/proto-loader; nothing here encodes the wire format by hand.

'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const USAGE = `usage: submit_watch_tail.js [options] (--spec FILE | -- COMMAND [ARG...])

  --server HOST:PORT     JobManager address (env DLSCHED_SERVER, default 127.0.0.1:50051)
  --spec FILE            the JobSpec as JSON, in proto-loader's object form: camelCase
                         field names, enum value names, Durations as {"seconds": N}
  --job-id ID            the job's id (else the server picks one)
  --request-id ID        idempotency key: a retry with the same id returns the first job
  --label KEY=VALUE      add a label to the job (repeatable)
  --watch-filter F       WatchJobs filter, e.g. labels.team=vision; it must match the job
                         (default: every job; events of other jobs are dropped)
  --protos DIR           root of the .proto tree (default: ../../protos from this file)
  --ca-file FILE         CA bundle the server is verified against (env DLSCHED_CA_FILE)
  --token-file FILE      bearer token sent on every call (env DLSCHED_TOKEN_FILE; or
                         env DLSCHED_TOKEN with the token itself)
  --insecure             plaintext, no TLS (only inside a mesh; env DLSCHED_INSECURE=1)
  -- COMMAND [ARG...]    shorthand for a SINGLE_PROCESS job with one replica running COMMAND`;

const TERMINAL = new Set(['JOB_STATE_SUCCEEDED', 'JOB_STATE_FAILED', 'JOB_STATE_STOPPED']);
const MAX_WATCH_RETRIES = 6;
// After the log stream ends (the job has ended), how long the watch may take
// to deliver the terminal state before we give up on it.
const WATCH_AFTER_LOGS_MS = 15000;
const UNARY_DEADLINE_MS = 30000;

class UsageError extends Error {}

function emit(obj) {
  process.stdout.write(JSON.stringify(obj) + '\n');
}

function emitError(obj) {
  process.stderr.write(JSON.stringify({ event: 'error', ...obj }) + '\n');
}

function rpcError(rpc, err) {
  return { rpc, code: grpc.status[err.code] ?? String(err.code), message: err.details ?? err.message };
}

function timestamp(ts) {
  if (!ts) return null;
  const ms = Number(ts.seconds) * 1000 + Math.floor((ts.nanos || 0) / 1e6);
  return new Date(ms).toISOString();
}

function jobSummary(job) {
  const out = {
    job: job.name,
    state: job.state,
    reason: job.reason,
    message: job.message,
    cluster: job.cluster,
    attempt: job.attempt,
    etag: job.etag,
  };
  if (job.exitCode !== undefined && job.exitCode !== null) out.exitCode = job.exitCode;
  return out;
}

// ------------------------------------------------------------------ arguments

function parseCli(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      server: { type: 'string', default: process.env.DLSCHED_SERVER || '127.0.0.1:50051' },
      spec: { type: 'string' },
      'job-id': { type: 'string', default: '' },
      'request-id': { type: 'string', default: '' },
      label: { type: 'string', multiple: true, default: [] },
      'watch-filter': { type: 'string', default: '' },
      protos: { type: 'string', default: path.resolve(__dirname, '..', '..', 'protos') },
      'ca-file': { type: 'string',
        default: process.env.DLSCHED_CA_FILE || process.env.DLSCHED_TLS_CA_FILE || '' },
      'token-file': { type: 'string', default: process.env.DLSCHED_TOKEN_FILE || '' },
      insecure: { type: 'boolean', default: ['1', 'true', 'yes'].includes(
        (process.env.DLSCHED_INSECURE || '').toLowerCase()) },
      help: { type: 'boolean', short: 'h', default: false },
    },
  });
  if (values.help) {
    process.stdout.write(USAGE + '\n');
    process.exit(0);
  }
  if (Boolean(values.spec) === (positionals.length > 0)) {
    throw new UsageError('give either --spec FILE or -- COMMAND [ARG...]');
  }
  let spec;
  if (values.spec) {
    spec = JSON.parse(fs.readFileSync(values.spec, 'utf8'));
  } else {
    spec = {
      runMode: 'RUN_MODE_SINGLE_PROCESS',
      replicaGroups: [{ role: 'main', replicas: 1, command: positionals }],
    };
  }
  spec.labels = { ...(spec.labels || {}) };
  for (const kv of values.label) {
    const i = kv.indexOf('=');
    if (i <= 0) throw new UsageError(`--label wants KEY=VALUE, got ${JSON.stringify(kv)}`);
    spec.labels[kv.slice(0, i)] = kv.slice(i + 1);
  }
  return {
    server: values.server,
    spec,
    jobId: values['job-id'],
    requestId: values['request-id'],
    watchFilter: values['watch-filter'],
    protos: values.protos,
    caFile: values['ca-file'],
    token: values['token-file']
      ? fs.readFileSync(values['token-file'], 'utf8').split('\n')[0].trim()
      : (process.env.DLSCHED_TOKEN || ''),
    insecure: values.insecure,
  };
}

// ------------------------------------------------------------------ client

// TLS verified against the CA (the system's roots without --ca-file), plus the
// bearer token as call credentials: "authorization: Bearer <token>" on every call.
function credentials(opts) {
  if (opts.insecure) return grpc.credentials.createInsecure();
  const ssl = grpc.credentials.createSsl(opts.caFile ? fs.readFileSync(opts.caFile) : null);
  if (!opts.token) return ssl;
  const bearer = grpc.credentials.createFromMetadataGenerator((_params, callback) => {
    const md = new grpc.Metadata();
    md.set('authorization', `Bearer ${opts.token}`);
    callback(null, md);
  });
  return grpc.credentials.combineChannelCredentials(ssl, bearer);
}

function jobManagerClient(protoRoot, server, opts) {
  const definition = protoLoader.loadSync('dlsched/v1/job_manager_service.proto', {
    includeDirs: [protoRoot],
    keepCase: false, // camelCase, as in protobuf's JSON mapping
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const { dlsched } = grpc.loadPackageDefinition(definition);
  return new dlsched.v1.JobManagerService(server, credentials(opts), {
    'grpc.max_receive_message_length': 8 * 1024 * 1024,
  });
}

function unary(client, rpc, request) {
  return new Promise((resolve, reject) => {
    client[rpc](request, { deadline: Date.now() + UNARY_DEADLINE_MS }, (err, resp) => {
      if (err) reject(Object.assign(err, { rpc }));
      else resolve(resp);
    });
  });
}

// ------------------------------------------------------------------ WatchJobs

// Watches jobs from before the submit, so the job's CREATED event and every
// change after it are seen. Reconnects with the last resume token when the
// stream breaks (UNAVAILABLE, or an unexpected OK end) and re-lists when the
// token has expired (OUT_OF_RANGE), as the WatchJobs comment asks.
class JobWatcher {
  constructor(client, filter) {
    this.client = client;
    this.filter = filter;
    this.token = '';
    this.name = null; // the followed job, known once SubmitJob returns
    this.early = []; // changes seen after the snapshot, before the name was known
    this.firstSnapshot = null; // EXISTING events of the first snapshot, by job name
    this.snapshot = new Map();
    this.retries = 0;
    this.closed = false;
    this.call = null;
    this.ready = null;
    this.done = null;
    this.error = null;
    this.last = null;
  }

  // Resolves once the first snapshot is complete.
  start() {
    return new Promise((resolve, reject) => {
      this.ready = { resolve, reject };
      this.open();
    });
  }

  // Resolves with the job's last state once a watch event shows it terminal
  // (or deleted).
  follow(name, submitted) {
    this.name = name;
    this.last = submitted;
    const promise = new Promise((resolve, reject) => {
      this.done = { resolve, reject };
    });
    if (this.error) {
      this.done.reject(this.error);
      return promise;
    }
    const existing = this.firstSnapshot.get(name);
    if (existing) this.deliver(existing); // a retried request_id: the job was there before
    for (const ev of this.early.splice(0)) this.deliver(ev);
    return promise;
  }

  open() {
    const call = this.client.WatchJobs({ filter: this.filter, resumeToken: this.token });
    let ended = false;
    this.call = call;
    call.on('data', (ev) => this.onEvent(ev));
    call.on('error', (err) => {
      if (ended) return;
      ended = true;
      this.onBroken(err);
    });
    call.on('end', () => {
      if (ended) return;
      ended = true;
      this.onBroken(Object.assign(new Error('WatchJobs ended'), { code: grpc.status.UNAVAILABLE }));
    });
  }

  onEvent(ev) {
    this.retries = 0;
    if (ev.resumeToken) this.token = ev.resumeToken;
    if (ev.type === 'WATCH_EVENT_TYPE_EXISTING') {
      this.snapshot.set(ev.job.name, ev);
      return;
    }
    if (ev.type === 'WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE') {
      const snapshot = this.snapshot;
      this.snapshot = new Map();
      if (this.firstSnapshot === null) {
        this.firstSnapshot = snapshot;
        this.ready.resolve();
      } else if (this.name !== null) {
        // A re-list after an expired token: its EXISTING event is the job now.
        const current = snapshot.get(this.name);
        if (current) this.deliver(current);
        else this.finish(this.last); // no longer listed: deleted while we were away
      }
      return;
    }
    this.deliver(ev);
  }

  deliver(ev) {
    if (this.closed) return;
    if (this.name === null) {
      this.early.push(ev);
      return;
    }
    if (!ev.job || ev.job.name !== this.name) return;
    emit({ event: 'watch', type: ev.type, ...jobSummary(ev.job), resumeToken: ev.resumeToken });
    this.last = ev.job;
    if (TERMINAL.has(ev.job.state) || ev.type === 'WATCH_EVENT_TYPE_DELETED') this.finish(ev.job);
  }

  onBroken(err) {
    if (this.closed) return;
    const code = err.code;
    const retriable = code === grpc.status.UNAVAILABLE || code === grpc.status.OUT_OF_RANGE;
    if (!retriable || this.retries >= MAX_WATCH_RETRIES) {
      this.fail(Object.assign(err, { rpc: 'WatchJobs' }));
      return;
    }
    if (code === grpc.status.OUT_OF_RANGE) this.token = ''; // WATCH_TOKEN_EXPIRED: re-list
    this.snapshot = new Map();
    const delay = 200 * 2 ** this.retries;
    this.retries += 1;
    emitError({ ...rpcError('WatchJobs', err), retryInMs: delay });
    setTimeout(() => {
      if (!this.closed) this.open();
    }, delay);
  }

  finish(job) {
    this.close();
    this.done.resolve(job);
  }

  fail(err) {
    this.close();
    this.error = err;
    if (this.ready && this.firstSnapshot === null) this.ready.reject(err);
    if (this.done) this.done.reject(err);
  }

  close() {
    if (this.closed) return;
    this.closed = true;
    if (this.call) this.call.cancel();
  }
}

// ------------------------------------------------------------------ StreamJobLogs

// Resolves when the followed log stream ends OK: the job has ended and its
// logs are drained.
function tailLogs(client, name) {
  return new Promise((resolve, reject) => {
    const call = client.StreamJobLogs({ name, follow: true });
    call.on('data', (resp) => {
      for (const e of resp.entries) {
        emit({
          event: 'log',
          role: e.role,
          replicaIndex: e.replicaIndex,
          stream: e.stream,
          time: timestamp(e.time),
          text: e.text,
        });
      }
    });
    call.on('error', (err) => reject(Object.assign(err, { rpc: 'StreamJobLogs' })));
    call.on('end', () => {
      emit({ event: 'logs_end', job: name });
      resolve();
    });
  });
}

function timeout(ms, what) {
  let timer;
  const promise = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(what)), ms);
  });
  promise.cancel = () => clearTimeout(timer);
  return promise;
}

// ------------------------------------------------------------------ main

async function main() {
  let opts;
  try {
    opts = parseCli(process.argv.slice(2));
  } catch (err) {
    emitError({ message: err.message });
    process.stderr.write(USAGE + '\n');
    return 2;
  }
  const client = jobManagerClient(opts.protos, opts.server, opts);
  const watcher = new JobWatcher(client, opts.watchFilter);
  try {
    await watcher.start();
    const resp = await unary(client, 'SubmitJob', {
      jobId: opts.jobId,
      spec: opts.spec,
      requestId: opts.requestId,
    });
    const job = resp.job;
    emit({ event: 'submitted', ...jobSummary(job), uid: job.uid });
    const finished = watcher.follow(job.name, job);
    // Rejections of either are handled by the awaits below.
    finished.catch(() => {});
    await tailLogs(client, job.name);
    const limit = timeout(WATCH_AFTER_LOGS_MS, `WatchJobs showed no end of ${job.name}`);
    let last;
    try {
      last = await Promise.race([finished, limit]);
    } finally {
      limit.cancel();
    }
    emit({ event: 'done', ...jobSummary(last) });
    return last.state === 'JOB_STATE_SUCCEEDED' ? 0 : 1;
  } catch (err) {
    emitError(err.rpc ? rpcError(err.rpc, err) : { message: err.message });
    return 2;
  } finally {
    watcher.close();
    client.close();
  }
}

main().then((code) => {
  process.exitCode = code;
});
