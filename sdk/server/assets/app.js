// oomguard knowledge-base browser. No framework, no network beyond this
// server's own /api (or nothing at all in a saved report).
//
// Safety rule for this file: incident data never becomes markup. Every node
// is made with createElement/createElementNS and filled with textContent or
// setAttribute; there is no innerHTML, insertAdjacentHTML or document.write.
// Links are built from '#/' plus encodeURIComponent, so data cannot choose
// a scheme.
//
// One ES module (strict, its names private to it without a wrapper
// function): compiled into the server as one asset and inlined whole into a
// saved report (report.cc), which may fetch nothing, so it imports nothing.
const SVGNS = 'http://www.w3.org/2000/svg';
const PAGE = 50;

// ---------- DOM helpers ----------

// el('div', {class: 'x', title: 't', href: '#/'}, child, 'text', [more])
function el(tag, props, ...kids) {
  const n = document.createElement(tag);
  setProps(n, props);
  append(n, kids);
  return n;
}
function svg(tag, props, ...kids) {
  const n = document.createElementNS(SVGNS, tag);
  setProps(n, props);
  // Charts render at their design width and only shrink (CSS max-width).
  if (tag === 'svg' && props && props.viewBox) n.setAttribute('width', props.viewBox.split(' ')[2]);
  append(n, kids);
  return n;
}
function setProps(n, props) {
  if (!props) return;
  for (const [k, v] of Object.entries(props)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'on') {
      for (const [ev, fn] of Object.entries(v)) n.addEventListener(ev, fn);
    } else if (k === 'text') {
      n.textContent = String(v);
    } else {
      n.setAttribute(k, String(v));
    }
  }
}
function append(n, kids) {
  for (const k of kids.flat(Infinity)) {
    if (k === undefined || k === null || k === false) continue;
    n.appendChild(typeof k === 'object' ? k : document.createTextNode(String(k)));
  }
}
function clear(n) {
  while (n.firstChild) n.removeChild(n.firstChild);
}
function link(hash, ...kids) {
  return el('a', {href: hash}, ...kids);
}
const enc = encodeURIComponent;

// ---------- formatting ----------

function fmtBytes(b) {
  if (b === undefined || b === null) return '-';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = Math.abs(b), u = 0;
  while (v >= 1024 && u < units.length - 1) { v /= 1024; u++; }
  const s = u === 0 ? String(v) : v.toFixed(v >= 100 ? 0 : 1);
  return (b < 0 ? '-' : '') + s + ' ' + units[u];
}
function fmtTime(ms) {
  if (!ms) return '-';
  return new Date(ms).toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
}
function fmtAgo(ms) {
  if (!ms) return 'never';
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s < 90) return Math.round(s) + ' s ago';
  if (s < 5400) return Math.round(s / 60) + ' min ago';
  if (s < 172800) return Math.round(s / 3600) + ' h ago';
  return Math.round(s / 86400) + ' days ago';
}
function fmtNum(n) { return Number(n || 0).toLocaleString('en-US'); }
function pct(a, b) { return b > 0 ? Math.round(100 * a / b) + '%' : '-'; }

const PATTERN_COLORS = {
  startup_capacity: '#6a51a3', activation_spike: '#e6550d', gradual_growth: '#d62728',
  fragmentation: '#3182bd', rank_imbalance: '#9c9ede', optimizer_state: '#31a354',
  host_dataloader: '#8c6d31', checkpoint_staging: '#17becf', workspace: '#bcbd22',
  foreign_memory: '#e377c2', unknown: '#888888',
};
function patternColor(p) { return PATTERN_COLORS[p] || PATTERN_COLORS.unknown; }
function patternBadge(p) {
  const b = el('span', {class: 'badge pattern', text: p || 'unclassified'});
  b.style.setProperty('--c', patternColor(p));
  return b;
}
function outcomeBadge(o) {
  const known = ['recovered', 'rolled_back', 'failed', 'pending'];
  return el('span', {class: 'badge outcome ' + (known.includes(o) ? o : 'none'), text: o ? o.replace('_', ' ') : 'no outcome'});
}

// ---------- data: the server's API, or the report's embedded copy ----------

const dataNode = document.getElementById('oomguard-data');
const REPORT = dataNode ? JSON.parse(dataNode.textContent) : null;

class ApiError extends Error {}

async function api(path, params) {
  if (REPORT) return local(path, params || {});
  const qs = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== '') qs.set(k, v);
  const url = path + (qs.toString() ? '?' + qs.toString() : '');
  const r = await fetch(url, {headers: {Accept: 'application/json'}});
  const body = await r.json().catch(() => ({error: 'HTTP ' + r.status}));
  if (!r.ok) throw new ApiError(body.error || ('HTTP ' + r.status));
  return body;
}

// The report has no server: the same endpoints answered from the embedded
// snapshot, with the server's filter semantics (sdk/kb/file_set.h).
function parseSince(s) {
  if (!s) return 0;
  const m = /^(\d+)([smhd]?)$/.exec(s);
  if (m) {
    const mult = {s: 1e3, m: 6e4, h: 36e5, d: 864e5}[m[2]];
    return mult ? Date.now() - Number(m[1]) * mult : Number(m[1]);
  }
  const t = Date.parse(s + 'T00:00:00Z');
  if (/^\d{4}-\d{2}-\d{2}$/.test(s) && !isNaN(t)) return t;
  throw new ApiError("parameter 'since': '" + s + "': expected a duration (30m, 12h, 7d), a date or unix milliseconds");
}
function matches(i, p) {
  if (p.pattern && i.pattern !== p.pattern) return false;
  if (p.rank !== undefined && p.rank !== '' && i.rank !== Number(p.rank)) return false;
  if (p.run && i.run_id !== p.run) return false;
  if (p.workload && i.workload !== p.workload) return false;
  if (p.fingerprint && i.fingerprint !== p.fingerprint) return false;
  if (p.since && i.time_unix_ms < parseSince(p.since)) return false;
  if (p.q) {
    const q = p.q.toLowerCase();
    const fields = [i.id, i.run_id, i.host, i.message, i.exception_type, i.pattern, i.workload, i.phase, i.kind,
      i.outcome, i.fingerprint, i.evidence];
    if (!fields.some((f) => (f || '').toLowerCase().includes(q))) return false;
  }
  return true;
}
function local(path, p) {
  const all = REPORT.incidents;
  if (path === '/api/incidents') {
    const hits = all.filter((i) => matches(i, p));
    const offset = Number(p.offset || 0), limit = Number(p.limit || PAGE);
    return {total: hits.length, offset, limit, items: hits.slice(offset, offset + limit)};
  }
  if (path.startsWith('/api/incidents/')) {
    const id = decodeURIComponent(path.slice('/api/incidents/'.length));
    const i = all.find((x) => x.id === id);
    if (!i) throw new ApiError("no incident with id '" + id + "'");
    return i;
  }
  if (path.startsWith('/api/runs/')) {
    const run = decodeURIComponent(path.slice('/api/runs/'.length));
    const pts = all.filter((x) => x.run_id === run)
      .sort((a, b) => a.step - b.step || a.time_unix_ms - b.time_unix_ms)
      .map((x) => ({id: x.id, step: x.step, time_unix_ms: x.time_unix_ms, rank: x.rank, micro_before: x.micro_before,
        micro_after: x.micro_after, pattern: x.pattern, action: x.action, outcome: x.outcome}));
    if (!pts.length) throw new ApiError("no run with id '" + run + "'");
    return {run_id: run, points: pts};
  }
  const docs = {'/api/runs': 'runs', '/api/groups': 'groups', '/api/patterns': 'patterns', '/api/stats': 'stats'};
  if (docs[path]) return REPORT[docs[path]];
  throw new ApiError('no such path');
}

// Small caches for data every view wants once.
let patternsCache = null;
async function patterns() {
  if (!patternsCache) patternsCache = await api('/api/patterns');
  return patternsCache;
}

// ---------- charts (SVG, sized by viewBox; every mark has a class the tests count) ----------

// Horizontal bars: incidents per pattern. Clicking a bar filters the table.
function patternChart(byPattern) {
  const rows = byPattern.filter((r) => r.count > 0);
  const W = 560, rowH = 24, left = 150, right = 50;
  const H = Math.max(1, rows.length) * rowH + 8;
  const max = Math.max(1, ...rows.map((r) => r.count));
  const s = svg('svg', {class: 'chart chart-patterns', viewBox: `0 0 ${W} ${H}`, role: 'img',
    'aria-label': 'incidents per pattern'});
  rows.forEach((r, k) => {
    const y = 4 + k * rowH;
    const w = Math.max(2, (W - left - right) * r.count / max);
    const g = svg('g', {class: 'bar-row', 'data-pattern': r.name});
    g.addEventListener('click', () => { location.hash = '#/?pattern=' + enc(r.name); });
    g.appendChild(svg('text', {x: left - 8, y: y + 16, 'text-anchor': 'end', class: 'label', text: r.name || 'unclassified'}));
    const bar = svg('rect', {class: 'bar', x: left, y: y + 3, width: w, height: rowH - 8, rx: 3});
    bar.style.fill = patternColor(r.name);
    g.appendChild(bar);
    g.appendChild(svg('text', {x: left + w + 6, y: y + 16, class: 'value', text: fmtNum(r.count)}));
    g.appendChild(svg('title', {text: `${r.name}: ${r.count} incident(s) - click to filter`}));
    s.appendChild(g);
  });
  return s;
}

// One stacked bar against capacity: allocated | cached by the allocator |
// held outside the allocator | free, plus the failed request beside free.
function memoryChart(m, requested) {
  const total = m.total || 0;
  const allocated = m.allocated || 0, reserved = Math.max(m.reserved || 0, allocated);
  const free = m.free || 0;
  const outside = total > 0 ? Math.max(0, total - reserved - free) : 0;
  const cap = total > 0 ? total : Math.max(reserved + free, 1);
  const W = 900, H = 60, barY = 6, barH = 30;
  const s = svg('svg', {class: 'chart chart-memory', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'device memory at the OOM'});
  s.appendChild(svg('rect', {class: 'capacity', x: 0, y: barY, width: W, height: barH}));
  const segs = [
    ['allocated', allocated, 'in live tensors'],
    ['cached', reserved - allocated, 'reserved by the allocator, not in use'],
    ['outside', outside, 'held outside this allocator (other process, NCCL, driver)'],
    ['free', free, 'free on the device'],
  ];
  let x = 0;
  for (const [name, bytes, what] of segs) {
    if (bytes <= 0) continue;
    const w = W * Math.min(bytes, cap) / cap;
    const r = svg('rect', {class: 'mem ' + name, x: x, y: barY, width: Math.max(w, 1), height: barH});
    r.appendChild(svg('title', {text: `${name}: ${fmtBytes(bytes)} (${pct(bytes, cap)}) - ${what}`}));
    s.appendChild(r);
    x += w;
  }
  if (requested > 0) {
    // The request drawn from the start of the free region: where it did not fit.
    const startX = W * Math.min(cap, reserved + outside) / cap;
    const w = Math.max(2, W * Math.min(requested, cap) / cap);
    const r = svg('rect', {class: 'mem request', x: startX, y: barY + barH + 4, width: Math.max(2, Math.min(w, W - startX)), height: 8});
    r.appendChild(svg('title', {text: `requested ${fmtBytes(requested)}; free ${fmtBytes(free)}`}));
    s.appendChild(r);
  }
  const legend = el('div', {class: 'legend'},
    segs.map(([name, bytes, what]) => el('span', {class: 'key ' + name, title: what},
      el('i'), `${name} ${fmtBytes(Math.max(0, bytes))}`)),
    requested > 0 ? el('span', {class: 'key request'}, el('i'), `requested ${fmtBytes(requested)}`) : null,
    el('span', {class: 'key capacity'}, el('i'), `capacity ${total > 0 ? fmtBytes(total) : 'unknown'}`));
  return el('div', {class: 'memory'}, s, legend);
}

// Step-peak history: one point per recorded step, capacity as a dashed line.
function peaksChart(peaks, total) {
  if (!peaks || !peaks.length) return el('p', {class: 'muted', text: 'No step history was recorded with this incident.'});
  const W = 420, H = 150, L = 56, R = 10, T = 10, B = 22;
  const hi = Math.max(total || 0, ...peaks) * 1.05;
  const lo = Math.min(...peaks) * 0.9;
  const y = (v) => T + (H - T - B) * (1 - (v - lo) / Math.max(1, hi - lo));
  const x = (k) => L + (peaks.length === 1 ? (W - L - R) / 2 : (W - L - R) * k / (peaks.length - 1));
  const s = svg('svg', {class: 'chart chart-peaks', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'peak memory of recent steps'});
  s.appendChild(svg('line', {class: 'axis', x1: L, y1: H - B, x2: W - R, y2: H - B}));
  for (const v of [lo, (lo + hi) / 2, hi]) {
    s.appendChild(svg('text', {class: 'tick', x: L - 6, y: y(v) + 4, 'text-anchor': 'end', text: fmtBytes(v)}));
    s.appendChild(svg('line', {class: 'grid', x1: L, y1: y(v), x2: W - R, y2: y(v)}));
  }
  if (total > 0) {
    s.appendChild(svg('line', {class: 'cap', x1: L, y1: y(total), x2: W - R, y2: y(total)}));
    s.appendChild(svg('text', {class: 'cap-label', x: W - R, y: y(total) - 4, 'text-anchor': 'end', text: 'capacity ' + fmtBytes(total)}));
  }
  s.appendChild(svg('polyline', {class: 'line', points: peaks.map((v, k) => `${x(k)},${y(v)}`).join(' ')}));
  peaks.forEach((v, k) => {
    const c = svg('circle', {class: 'point', cx: x(k), cy: y(v), r: 3.5});
    c.appendChild(svg('title', {text: `step -${peaks.length - k}: peak ${fmtBytes(v)}`}));
    s.appendChild(c);
  });
  s.appendChild(svg('text', {class: 'tick', x: L, y: H - 6, text: `${peaks.length} steps before the OOM →`}));
  return s;
}

// Every rank side by side: reserved (light), allocated (solid), peak (tick).
function ranksChart(ranks, total, current) {
  if (!ranks || !ranks.length) return el('p', {class: 'muted', text: 'Only one rank recorded (no per-rank figures).'});
  const W = Math.max(260, Math.min(720, 60 * ranks.length + 70)), H = 170, L = 56, T = 10, B = 24;
  const hi = Math.max(total || 0, ...ranks.map((r) => Math.max(r.reserved || 0, r.peak_allocated || 0, r.allocated || 0)), 1);
  const y = (v) => T + (H - T - B) * (1 - v / hi);
  const slot = (W - L - 10) / ranks.length, bw = Math.min(36, slot * 0.6);
  const s = svg('svg', {class: 'chart chart-ranks', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'memory per rank'});
  s.appendChild(svg('line', {class: 'axis', x1: L, y1: H - B, x2: W - 10, y2: H - B}));
  s.appendChild(svg('text', {class: 'tick', x: L - 6, y: y(hi) + 4, 'text-anchor': 'end', text: fmtBytes(hi)}));
  s.appendChild(svg('text', {class: 'tick', x: L - 6, y: y(0), 'text-anchor': 'end', text: '0'}));
  if (total > 0) s.appendChild(svg('line', {class: 'cap', x1: L, y1: y(total), x2: W - 10, y2: y(total)}));
  ranks.forEach((r, k) => {
    const cx = L + slot * k + slot / 2;
    const g = svg('g', {class: 'rank' + (r.rank === current ? ' current' : '')});
    if (r.reserved > 0) g.appendChild(svg('rect', {class: 'reserved', x: cx - bw / 2, y: y(r.reserved), width: bw, height: y(0) - y(r.reserved)}));
    const used = r.allocated || r.peak_allocated || 0;
    g.appendChild(svg('rect', {class: 'rank-bar', x: cx - bw / 2 + 4, y: y(used), width: bw - 8, height: Math.max(1, y(0) - y(used))}));
    if (r.peak_allocated > 0) g.appendChild(svg('line', {class: 'peak', x1: cx - bw / 2, x2: cx + bw / 2, y1: y(r.peak_allocated), y2: y(r.peak_allocated)}));
    g.appendChild(svg('text', {class: 'tick', x: cx, y: H - 8, 'text-anchor': 'middle', text: 'rank ' + r.rank}));
    g.appendChild(svg('title', {text: `rank ${r.rank}: allocated ${fmtBytes(r.allocated)}, reserved ${fmtBytes(r.reserved)}, peak ${fmtBytes(r.peak_allocated)}`}));
    s.appendChild(g);
  });
  const legend = el('div', {class: 'legend'},
    el('span', {class: 'key allocated'}, el('i'), 'allocated (or peak when only that is known)'),
    el('span', {class: 'key reserved'}, el('i'), 'reserved'),
    el('span', {class: 'key peak'}, el('i'), 'peak'),
    total > 0 ? el('span', {class: 'key capacity-line'}, el('i'), 'capacity ' + fmtBytes(total)) : null);
  return el('div', {}, s, legend);
}

// Micro-batch size over the run's steps: a step line that drops at every
// OOM (micro_before -> micro_after), with the OOMs marked.
function timelineChart(points, currentId, opts) {
  opts = opts || {};
  const W = opts.width || 900, H = opts.height || 190, L = 48, R = 14, T = 12, B = 26;
  const steps = points.map((p) => p.step);
  const sizes = points.flatMap((p) => [p.micro_before, p.micro_after]).filter((v) => v > 0);
  const s = svg('svg', {class: 'chart chart-timeline', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'micro-batch size over steps'});
  const s0 = Math.min(...steps), s1 = Math.max(...steps);
  const span = Math.max(1, s1 - s0);
  const x = (st) => L + (W - L - R) * (points.length === 1 ? 0.5 : (st - s0) / span);
  const hi = Math.max(1, ...sizes) * 1.1;
  const y = (v) => T + (H - T - B) * (1 - v / hi);
  s.appendChild(svg('line', {class: 'axis', x1: L, y1: H - B, x2: W - R, y2: H - B}));
  s.appendChild(svg('text', {class: 'tick', x: L - 6, y: y(hi / 1.1) + 4, 'text-anchor': 'end', text: fmtNum(Math.round(hi / 1.1))}));
  s.appendChild(svg('text', {class: 'tick', x: L - 6, y: y(0), 'text-anchor': 'end', text: '0'}));
  s.appendChild(svg('text', {class: 'tick', x: L, y: H - 8, text: 'step ' + fmtNum(s0)}));
  if (points.length > 1) s.appendChild(svg('text', {class: 'tick', x: W - R, y: H - 8, 'text-anchor': 'end', text: 'step ' + fmtNum(s1)}));
  if (sizes.length) {
    const pts = [];
    let cur = points[0].micro_before || points[0].micro_after || 0;
    pts.push([x(s0) - (points.length === 1 ? 40 : 0), y(cur)]);
    // Between OOMs the guard may have grown the size again (a probe); the
    // records only say what it was at each OOM, so the rise is drawn there.
    for (const p of points) {
      const before = p.micro_before || cur, after = p.micro_after || before;
      pts.push([x(p.step), y(cur)], [x(p.step), y(before)], [x(p.step), y(after)]);
      cur = after;
    }
    pts.push([W - R, y(cur)]);
    s.appendChild(svg('polyline', {class: 'line micro', points: pts.map(([a, b]) => `${a},${b}`).join(' ')}));
  }
  points.forEach((p) => {
    const cls = 'oom ' + (p.outcome || 'none') + (p.id === currentId ? ' current' : '');
    const c = svg('circle', {class: cls, cx: x(p.step), cy: y(p.micro_before || p.micro_after || 0), r: p.id === currentId ? 7 : 5});
    c.addEventListener('click', () => { location.hash = '#/incident/' + enc(p.id); });
    c.appendChild(svg('title', {text: `step ${p.step}, rank ${p.rank}: ${p.pattern || 'unclassified'}, micro-batch ${p.micro_before} → ${p.micro_after}, ${p.outcome || 'no outcome'}`}));
    s.appendChild(c);
  });
  return s;
}

// ---------- views ----------

const app = document.getElementById('app');

function parseHash() {
  const h = location.hash.replace(/^#/, '') || '/';
  const [path, query] = h.split('?');
  const params = {};
  new URLSearchParams(query || '').forEach((v, k) => { params[k] = v; });
  return {parts: path.split('/').filter(Boolean).map(decodeURIComponent), params};
}
function hashWith(params) {
  const qs = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== '' && v !== null) qs.set(k, v);
  const s = qs.toString();
  return '#/' + (s ? '?' + s : '');
}

function card(title, ...body) {
  return el('section', {class: 'card'}, title ? el('h2', {text: title}) : null, ...body);
}
function stat(label, value, cls) {
  return el('div', {class: 'stat ' + (cls || '')}, el('div', {class: 'value', text: value}), el('div', {class: 'label', text: label}));
}

async function viewIncidents(params) {
  const [stats, pats, page] = await Promise.all([
    api('/api/stats'), patterns(),
    api('/api/incidents', Object.assign({}, params, {limit: PAGE})),
  ]);
  const count = (arr, name) => (arr.find((r) => r.name === name) || {count: 0}).count;
  const failed = count(stats.by_outcome, 'failed');
  const summary = el('div', {class: 'stats'},
    stat('incidents', fmtNum(stats.incidents)),
    stat('recovered', fmtNum(count(stats.by_outcome, 'recovered')), 'good'),
    stat('rolled back', fmtNum(count(stats.by_outcome, 'rolled_back')), count(stats.by_outcome, 'rolled_back') ? 'warn' : ''),
    stat('failed', fmtNum(failed), failed ? 'bad' : ''),
    stat('last incident', fmtAgo(stats.last_incident_unix_ms)),
    stat('recurring groups', fmtNum(stats.groups)));

  // Filters: each change rewrites the hash, which re-renders (shareable URLs).
  const go = (patch) => { location.hash = hashWith(Object.assign({}, params, patch, {offset: undefined})); };
  const q = el('input', {type: 'search', id: 'f-q', placeholder: 'search message, id, host, workload…', value: params.q || ''});
  q.addEventListener('keydown', (e) => { if (e.key === 'Enter') go({q: q.value}); });
  const pat = el('select', {id: 'f-pattern'}, el('option', {value: '', text: 'all patterns'}),
    pats.map((p) => el('option', {value: p.name, text: `${p.name} (${p.count})`, selected: p.name === params.pattern})),
    el('option', {value: 'unknown', text: 'unknown', selected: params.pattern === 'unknown'}));
  pat.addEventListener('change', () => go({pattern: pat.value}));
  const rank = el('input', {type: 'number', min: 0, id: 'f-rank', placeholder: 'rank', value: params.rank || ''});
  rank.addEventListener('change', () => go({rank: rank.value}));
  const run = el('input', {type: 'text', id: 'f-run', placeholder: 'run id', value: params.run || ''});
  run.addEventListener('change', () => go({run: run.value}));
  const since = el('select', {id: 'f-since'},
    [['', 'any time'], ['1h', 'last hour'], ['24h', 'last 24 h'], ['7d', 'last 7 days'], ['30d', 'last 30 days']]
      .map(([v, t]) => el('option', {value: v, text: t, selected: (params.since || '') === v})));
  since.addEventListener('change', () => go({since: since.value}));
  const filters = el('form', {class: 'filters', on: {submit: (e) => { e.preventDefault(); go({q: q.value}); }}},
    q, pat, rank, run, since, el('button', {type: 'submit', text: 'Search'}),
    Object.keys(params).length ? link('#/', 'clear filters') : null);
  const active = ['fingerprint', 'workload'].filter((k) => params[k])
    .map((k) => el('span', {class: 'chip'}, `${k} = ${params[k]}`));

  const rows = page.items.map((i) => el('tr', {class: 'incident-row', 'data-id': i.id,
    on: {click: (e) => { if (e.target.tagName !== 'A') location.hash = '#/incident/' + enc(i.id); }}},
    el('td', {class: 'time', title: fmtAgo(i.time_unix_ms), text: fmtTime(i.time_unix_ms)}),
    el('td', {}, patternBadge(i.pattern)),
    el('td', {}, outcomeBadge(i.outcome)),
    el('td', {text: [i.phase, i.kind].filter(Boolean).join(' / ') || '-'}),
    el('td', {text: `${i.host || '?'} / r${i.rank}`}),
    el('td', {class: 'num', text: fmtNum(i.step)}),
    el('td', {class: 'num', text: i.micro_before ? `${i.micro_before} → ${i.micro_after || '?'}` : '-'}),
    el('td', {class: 'num', text: i.requested_bytes ? fmtBytes(i.requested_bytes) : '-'}),
    el('td', {class: 'msg'}, link('#/incident/' + enc(i.id), i.id), el('span', {class: 'message', text: i.message || i.evidence || ''}))));
  const table = el('table', {class: 'incidents'},
    el('thead', {}, el('tr', {}, ['time (UTC)', 'pattern', 'outcome', 'phase / kind', 'host / rank', 'step',
      'micro-batch', 'requested', 'incident'].map((h) => el('th', {text: h})))),
    el('tbody', {}, rows));
  const offset = Number(params.offset || 0);
  const pager = el('div', {class: 'pager'},
    el('span', {id: 'total', text: page.total ? `${fmtNum(offset + 1)}–${fmtNum(offset + page.items.length)} of ${fmtNum(page.total)}` : 'no incidents match'}),
    offset > 0 ? link(hashWith(Object.assign({}, params, {offset: Math.max(0, offset - PAGE) || undefined})), '← newer') : null,
    offset + PAGE < page.total ? link(hashWith(Object.assign({}, params, {offset: offset + PAGE})), 'older →') : null);
  return [summary,
    el('div', {class: 'row'},
      card('Incidents per pattern', stats.by_pattern.length ? patternChart(stats.by_pattern) : el('p', {class: 'muted', text: 'No incidents yet.'})),
      card('By outcome and kind',
        el('ul', {class: 'counts'}, stats.by_outcome.map((r) => el('li', {}, outcomeBadge(r.name), ' ', fmtNum(r.count)))),
        el('ul', {class: 'counts'}, stats.by_kind.map((r) => el('li', {}, el('b', {text: r.name || 'unknown'}), ' ', fmtNum(r.count)))),
        stats.dropped ? el('p', {class: 'warn-text', text: `${fmtNum(stats.dropped)} incident(s) were dropped by full queues.`}) : null)),
    card(null, filters, active, el('div', {class: 'table-wrap'}, table), pager)];
}

async function viewIncident(id) {
  const [i, pats] = await Promise.all([api('/api/incidents/' + enc(id)), patterns()]);
  const p = pats.find((x) => x.name === i.pattern);
  const m = i.memory || {};
  const h = i.history || {};
  const run = i.run_id ? await api('/api/runs/' + enc(i.run_id)).catch(() => null) : null;
  // The case library: nearest past incidents and what resolved them (none in a static report).
  const similar = await api('/api/incidents/' + enc(id) + '/similar').catch(() => null);
  // The team's note on this incident's group (none yet: a 404).
  const note = i.fingerprint ? await api('/api/notes/' + enc(i.fingerprint)).catch(() => null) : null;
  const fact = (k, v) => el('div', {class: 'fact'}, el('dt', {text: k}), el('dd', {}, v));
  const rungs = (i.actions && i.actions.length) ? i.actions : (i.action ? [i.action] : []);
  const ladderNames = {release: 'release caches', halve: 'halve the micro-batch', rollback: 'roll back to checkpoint', give_up: 'give up'};
  return [
    el('div', {class: 'crumbs'}, link('#/', '← all incidents'), i.run_id ? [' · ', link('#/run/' + enc(i.run_id), 'run ' + i.run_id)] : null),
    el('section', {class: 'card headline'},
      el('div', {class: 'title'}, patternBadge(i.pattern), outcomeBadge(i.outcome),
        el('h1', {id: 'incident-title', text: p ? p.title : (i.pattern || 'unclassified OOM')})),
      el('p', {class: 'meta', text: `${fmtTime(i.time_unix_ms)} (${fmtAgo(i.time_unix_ms)}) · ${i.host || 'unknown host'} · rank ${i.rank} of ${i.world_size} · step ${fmtNum(i.step)}` +
        `${i.micro_index >= 0 ? ', micro-batch #' + i.micro_index : ''} · ${i.phase || 'unknown phase'} · ${i.kind || '?'} memory${i.injected ? ' · injected by fault rule' : ''}`}),
      el('div', {class: 'message-box'}, i.exception_type ? el('div', {class: 'exc', text: i.exception_type}) : null,
        el('pre', {id: 'message', text: i.message || '(no message)'})),
      el('dl', {class: 'facts'},
        fact('id', el('code', {text: i.id})),
        fact('workload', i.workload ? link(hashWith({workload: i.workload}), i.workload) : '-'),
        fact('requested', fmtBytes(i.requested_bytes)),
        fact('fingerprint', i.fingerprint ? link(hashWith({fingerprint: i.fingerprint}), i.fingerprint) : '-'),
        fact('clean steps before', fmtNum(h.steps_ok_before)),
        i.sample_cost && i.sample_cost.median ? fact('sample cost', `${i.sample_cost.this} vs median ${i.sample_cost.median} (×${(i.sample_cost.this / i.sample_cost.median).toFixed(1)})`) : null)),
    noteCard(i.fingerprint, note),
    el('div', {class: 'row'},
      card('Diagnosis', el('p', {class: 'confidence'}, 'pattern ', el('b', {text: i.pattern || 'unclassified'}),
        ` · confidence ${Math.round((i.confidence || 0) * 100)}%`),
      el('p', {class: 'evidence', id: 'evidence', text: i.evidence || 'No evidence recorded.'}),
      el('h3', {text: 'What to do'}),
      (i.remedies && i.remedies.length) ? el('ol', {class: 'remedies'}, i.remedies.map((r) => el('li', {text: r}))) : el('p', {class: 'muted', text: 'No remedies recorded.'}),
      p ? el('p', {class: 'muted small'}, 'Pattern signal: ', p.signal) : null),
      card('What the guard did',
        rungs.length ? el('ol', {class: 'ladder'}, rungs.map((r) => el('li', {class: 'rung ' + r, text: ladderNames[r] || r}))) : el('p', {class: 'muted', text: 'No ladder rung recorded.'}),
        el('p', {}, 'micro-batch ', el('b', {text: i.micro_before ? String(i.micro_before) : '?'}), ' → ', el('b', {text: i.micro_after ? String(i.micro_after) : '?'}),
          ' · ', outcomeBadge(i.outcome), i.recovery_ms ? ` in ${Number(i.recovery_ms).toFixed(1)} ms` : ''))),
    card('Memory at the OOM', memoryChart(m, i.requested_bytes),
      el('p', {class: 'muted small', text: `peak allocated ${fmtBytes(m.peak_allocated)} · stranded in split blocks ${fmtBytes(m.inactive_split)} · allocator retries ${fmtNum(m.num_alloc_retries)}`})),
    el('div', {class: 'row'},
      card('Peak memory of recent steps', peaksChart(h.step_peaks, m.total)),
      card('Every rank', ranksChart(i.ranks, m.total, i.rank))),
    similar && similar.length ? card('Similar past incidents', el('ol', {class: 'similar', id: 'similar'}, similar.map((s) =>
      el('li', {}, link('#/incident/' + enc(s.id), s.id), ' ', patternBadge(s.pattern),
        el('span', {class: 'muted small', text: ` ${Math.round(s.score * 100)}% · ${s.why} · ${fmtTime(s.time_unix_ms)}`}),
        el('div', {class: 'small', text: 'resolved: ' + s.resolution}))))) : null,
    run ? card(`Run ${i.run_id}: micro-batch size over steps (${run.points.length} OOM${run.points.length === 1 ? '' : 's'})`,
      timelineChart(run.points, i.id), el('p', {class: 'muted small', text: 'Circles are OOMs (click one to open it); the line is the micro-batch size the guard ran with.'})) : null,
  ];
}

// The token that lets this page write notes (`kb serve --notes-token-file`):
// asked for once, kept in this page's memory only.
let noteToken = '';

// A group's note, shown with each of its incidents; the server writes it
// only with the token, so anyone may read and the form says what it needs.
function noteCard(fingerprint, note) {
  if (!fingerprint) return null;
  const shown = note
    ? el('p', {class: 'team-note', id: 'team-note', text: note.text})
    : el('p', {class: 'muted', id: 'team-note-none', text: 'No team note on this group yet.'});
  const by = note ? el('p', {class: 'muted small', text: `${note.author || 'someone'} · ${fmtTime(note.updated_unix_ms)} · on every incident of group ${fingerprint}`}) : null;
  if (REPORT) return card('Team note', shown, by);
  const text = el('input', {type: 'text', id: 'note-text', maxlength: 256, value: note ? note.text : '', placeholder: 'e.g. fixed by expandable_segments'});
  const author = el('input', {type: 'text', id: 'note-author', maxlength: 64, placeholder: 'your name'});
  const token = el('input', {type: 'password', id: 'note-token', placeholder: 'token (kb serve --notes-token-file)', value: noteToken});
  const status = el('span', {class: 'muted small', id: 'note-status'});
  const save = async (e) => {
    e.preventDefault();
    noteToken = token.value;
    const qs = new URLSearchParams({text: text.value, author: author.value});
    status.textContent = 'saving…';
    try {
      const r = await fetch('/api/notes/' + enc(fingerprint) + '?' + qs.toString(),
        {method: 'POST', headers: {Accept: 'application/json', Authorization: 'Bearer ' + noteToken}});
      const body = await r.json().catch(() => ({error: 'HTTP ' + r.status}));
      if (!r.ok) throw new ApiError(body.error || ('HTTP ' + r.status));
      status.textContent = 'saved; it shows with the next reload of the knowledge base';
      setTimeout(render, 1500);
    } catch (err) {
      status.textContent = 'not saved: ' + err.message;
    }
  };
  return card('Team note', shown, by,
    el('form', {class: 'note-form', on: {submit: save}}, text, author, token, el('button', {type: 'submit', text: note ? 'Update' : 'Add note'}), status));
}

async function viewRuns() {
  const runs = await api('/api/runs');
  if (!runs.length) return card('Runs', el('p', {class: 'muted', text: 'No incidents yet.'}));
  const shown = runs.slice(0, 20);
  const timelines = await Promise.all(shown.map((r) => api('/api/runs/' + enc(r.run_id)).catch(() => null)));
  return [el('p', {class: 'muted', text: runs.length > 20 ? `The 20 most recent of ${runs.length} runs.` : `${runs.length} run(s).`}),
    shown.map((r, k) => card(null,
      el('div', {class: 'run-head'}, link('#/run/' + enc(r.run_id), el('b', {text: r.run_id || '(no run id)'})),
        el('span', {class: 'muted', text: ` ${r.workload || ''} · ${fmtNum(r.incidents)} OOM(s)${r.failed ? `, ${r.failed} failed` : ''} · steps ${r.first_step}–${r.last_step} · ${fmtTime(r.last_unix_ms)} · ${r.hosts.filter(Boolean).join(', ')}`})),
      timelines[k] ? timelineChart(timelines[k].points, null, {height: 120}) : null))];
}

async function viewRun(runId) {
  const [run, page] = await Promise.all([api('/api/runs/' + enc(runId)), api('/api/incidents', {run: runId, limit: PAGE})]);
  return [el('div', {class: 'crumbs'}, link('#/runs', '← all runs')),
    card(`Run ${runId}: micro-batch size over steps`, timelineChart(run.points, null)),
    card(`${fmtNum(page.total)} incident(s)`, el('ul', {class: 'plain'}, page.items.map((i) => el('li', {},
      link('#/incident/' + enc(i.id), `step ${i.step}`), ' ', patternBadge(i.pattern), ' ', outcomeBadge(i.outcome),
      ' ', el('span', {class: 'muted', text: `rank ${i.rank} · micro-batch ${i.micro_before} → ${i.micro_after}`})))))];
}

async function viewGroups() {
  const groups = await api('/api/groups');
  const rows = groups.map((g) => el('tr', {class: 'group-row'},
    el('td', {class: 'num', text: fmtNum(g.count)}), el('td', {class: 'num', text: fmtNum(g.runs)}),
    el('td', {}, patternBadge(g.pattern)), el('td', {text: [g.phase, g.kind].filter(Boolean).join(' / ')}),
    el('td', {text: g.workload || '-'}), el('td', {text: fmtTime(g.first_seen_unix_ms)}), el('td', {text: fmtTime(g.last_seen_unix_ms)}),
    el('td', {}, link(hashWith({fingerprint: g.fingerprint}), g.fingerprint), ' · ', link('#/incident/' + enc(g.last_id), 'newest'))));
  return card('Recurring incidents (grouped by fingerprint)', el('div', {class: 'table-wrap'}, el('table', {class: 'groups'},
    el('thead', {}, el('tr', {}, ['count', 'runs', 'pattern', 'phase / kind', 'workload', 'first seen', 'last seen', 'fingerprint']
      .map((h) => el('th', {text: h})))), el('tbody', {}, rows))));
}

async function viewPatterns() {
  const pats = await patterns();
  return pats.map((p) => el('section', {class: 'card pattern-card', id: 'pattern-' + p.name},
    el('div', {class: 'title'}, patternBadge(p.name), el('h2', {text: p.title}),
      p.count ? link(hashWith({pattern: p.name}), `${fmtNum(p.count)} incident(s)`) : el('span', {class: 'muted', text: 'no incidents'})),
    el('p', {}, el('b', {text: 'Looks like: '}), p.signal),
    el('p', {class: 'muted small'}, el('b', {text: 'Rule: '}), p.rule),
    el('ol', {class: 'remedies'}, p.remedies.map((r) => el('li', {text: r})))));
}

let renderSeq = 0;
async function render() {
  const seq = ++renderSeq;
  const {parts, params} = parseHash();
  const section = parts[0] || 'incidents';
  for (const a of document.querySelectorAll('nav a')) {
    a.classList.toggle('active', a.dataset.nav === (section === 'incident' ? 'incidents' : section === 'run' ? 'runs' : section));
  }
  let nodes;
  try {
    if (section === 'incident' && parts[1] !== undefined) nodes = await viewIncident(parts[1]);
    else if (section === 'run' && parts[1] !== undefined) nodes = await viewRun(parts[1]);
    else if (section === 'runs') nodes = await viewRuns();
    else if (section === 'groups') nodes = await viewGroups();
    else if (section === 'patterns') nodes = await viewPatterns();
    else nodes = await viewIncidents(params);
  } catch (e) {
    nodes = el('section', {class: 'card error'}, el('h2', {text: 'Cannot show this'}), el('p', {id: 'error', text: e.message}), link('#/', 'back to all incidents'));
  }
  if (seq !== renderSeq) return;  // a newer navigation already started
  clear(app);
  append(app, [nodes]);
  app.dataset.view = section;
  app.dataset.ready = '1';
}

const source = document.getElementById('source');
if (REPORT) source.textContent = `report generated ${fmtTime(REPORT.generated_unix_ms)} · ${REPORT.incidents.length} incidents`;
else api('/api/stats').then((s) => { source.textContent = s.files.map((f) => f.db).join(', '); }).catch(() => {});
window.addEventListener('hashchange', render);
render();
