-- wrk script for scripts/bench: every scenario and every HTTP reference.
--
--   wrk -t T -c C -d D -s ledger.lua URL -- <mode> <dir> <api_key> [mode args...]
--
-- modes (the service):
--   issue  <biz1,biz2,...> <subjects> [limit]
--          POST /v1/tokens, rotating over the biz types; every 201 answer's
--          token and subject are appended to <dir>/tok-<biz>-<tid> (the token
--          source of the consume scenarios). [limit]: stop a thread after that
--          many tokens (top-up runs).
--   consume <file prefix> <rid|plain> [copies]
--          POST /v1/tokens/<token>/consume, each token of <prefix><tid> once
--          (copies = 10: the double-click storm, the same body 10 times in a
--          row, on 10 different connections). rid: the body carries a unique
--          request_id and fingerprint; plain: only the subject.
--   forged <file prefix>
--          consume of tokens whose tag was altered (one base64 character
--          changed): every answer must be 400 token_invalid.
--   pay    <file prefix>
--          POST /v1/orders/<order>/pay, lines "token subject order_id".
--   mixed  <file prefix> <issue biz> <subjects>
--          every fifth request issues, the others consume (rid bodies).
--   keys   <biz> <tag> <claim|complete>
--          POST /v1/keys/consume of new client keys "<tag>-<tid>-<n>" (body
--          with a request_id); complete: each key answered `consumed` is
--          then completed (POST /v1/keys/result) before the next new key of
--          that connection slot, so that claims and results alternate (a
--          claim-then-complete cycle is two requests; `completed` counts
--          the results recorded).
--   keys   <biz> <tag> prepare <count>
--          as complete, for keys 1..<count> of each thread, then the thread
--          stops (not measured: the keys a replay run asks for).
--   keys   <biz> <tag> replay <count>
--          POST /v1/keys/consume of the prepared keys "<tag>-<tid>-<n>",
--          n = 1..<count> over and over, with no request_id (a client's
--          retry after the first answer was lost): every answer must be
--          `duplicate` with status `completed` (counted as
--          `duplicate_completed`).
-- modes (the peer, svix's diom, started by hand: its idempotency API with
-- the same shapes of work; the Authorization key is the peer's token):
--   dkeys  <tag> <claim|complete|prepare|replay> [count]
--          claim: POST /api/v1.idempotency.start of new keys (answer
--          `started`, counted as `consumed`); complete: each started key is
--          then completed (POST /api/v1.idempotency.complete with a small
--          response) before the next new key, as for `keys`; prepare and
--          replay: as for `keys` (a replay's answer must be `completed`).
-- modes (references):
--   get    <path>            GET <path>, nothing else (the empty handler)
--   seq    <path prefix> <tag>  GET <prefix><tag>-<tid>-<n>, a fresh id per
--                            request (actix + one Redis call: the answer "1"
--                            is a hit or a fresh key, "0" a miss or a clash)
--
-- Every thread counts what it saw; done() prints one line
-- "BENCHJSON {...}" with wrk's totals, latency percentiles (us) and the
-- counters, summed over threads. A consume answered `consumed` (not replayed)
-- is counted per token; `doubles` is the number of tokens answered `consumed`
-- more than once (tokens are never shared between threads, so a per-thread
-- count is complete). When a thread runs out of tokens it stops itself; the
-- few requests already sent after that are GET /healthz "fillers", counted
-- apart and left out of the request rate.

local threads = {}
local nthreads = 0

function setup(thread)
  thread:set("tid", nthreads)
  nthreads = nthreads + 1
  table.insert(threads, thread)
end

local mode, dir, key
local auth_headers, get_headers
-- Globals, read by done() with thread:get (which copies flat tables only):
counters = {}            -- name -> count
issued_bizs = ""         -- "order,view": the biz types of issued_<biz>
-- issued_<biz> = { "token subject", ... }: the tokens this thread was issued
local function inc(name, by)
  counters[name] = (counters[name] or 0) + (by or 1)
end

-- per-mode state
local tokens = {}        -- { {token, subject, order}, ... }
local pos = 0            -- next token index (1-based after increment)
local copies = 1
local copy_left = 0
local body_style = "plain"
local biz_list = {}
local biz_i = 0
local subjects = 1000
local seq = 0
local limit = nil
local seen = {}          -- token -> times answered consumed
local exhausted = false
local path_prefix = "/"
local id_tag = "benchref"
local inflight = 0       -- requests sent and not answered yet (fillers apart)
local complete = false   -- keys: send each claimed key's result
local pending = {}       -- keys: claimed keys whose result is not sent yet
local key_style = "claim" -- keys, dkeys: claim, complete, prepare or replay
local key_count = nil    -- keys, dkeys: prepare and replay, keys per thread
local peer = false       -- dkeys: the peer's API
local sent = {}          -- dkeys: keys started and not answered yet, sent[sent_head..sent_tail]
local sent_head, sent_tail = 1, 0

local function load_tokens(path)
  local f = io.open(path, "r")
  if not f then return end
  for line in f:lines() do
    local t, s, o = line:match("^(%S+)%s+(%S+)%s*(%S*)$")
    if t then table.insert(tokens, { t, s, o }) end
  end
  f:close()
end

function init(args)
  mode = args[1]
  dir = args[2]
  _G.dir = dir
  key = args[3]
  auth_headers = {
    ["Authorization"] = "Bearer " .. (key or ""),
    ["Content-Type"] = "application/json",
  }
  get_headers = {}
  counters.tid = tid
  if mode == "issue" then
    for b in string.gmatch(args[4], "[^,]+") do table.insert(biz_list, b) end
    subjects = tonumber(args[5] or "1000")
    limit = args[6] and tonumber(args[6]) or nil
  elseif mode == "consume" then
    load_tokens(args[4] .. tid)
    body_style = args[5] or "plain"
    copies = tonumber(args[6] or "1")
  elseif mode == "forged" or mode == "pay" then
    load_tokens(args[4] .. tid)
  elseif mode == "mixed" then
    load_tokens(args[4] .. tid)
    biz_list = { args[5] }
    subjects = tonumber(args[6] or "1000")
    body_style = "rid"
  elseif mode == "keys" or mode == "dkeys" then
    local i = 4
    if mode == "keys" then
      biz_list = { args[4] }
      i = 5
    else
      peer = true
    end
    id_tag = args[i] or "k"
    key_style = args[i + 1] or "claim"
    key_count = tonumber(args[i + 2] or "")
    complete = key_style == "complete" or key_style == "prepare"
  elseif mode == "get" then
    path_prefix = args[4] or "/"
  elseif mode == "seq" then
    path_prefix = args[4] or "/"
    id_tag = args[5] or "benchref"
  end
  counters.tokens_loaded = #tokens
end

local function issue_request()
  biz_i = biz_i % #biz_list + 1
  seq = seq + 1
  local body = string.format('{"biz_type":"%s","subject":"u%d-%d"}',
    biz_list[biz_i], tid, seq % subjects)
  inflight = inflight + 1
  return wrk.format("POST", "/v1/tokens", auth_headers, body)
end

local function filler()
  if peer then return wrk.format("GET", "/api/v1.health.ping", get_headers) end
  return wrk.format("GET", "/healthz", get_headers)
end

local function next_token()
  if copy_left > 0 then
    copy_left = copy_left - 1
    return tokens[pos]
  end
  if pos >= #tokens then
    exhausted = true
    return nil
  end
  pos = pos + 1
  copy_left = copies - 1
  return tokens[pos]
end

local function consume_request()
  local t = next_token()
  if not t then return filler() end
  local body
  if body_style == "rid" then
    body = string.format('{"subject":"%s","request_id":"r%d-%d","fingerprint":"sha256:%d-%d"}',
      t[2], tid, pos, tid, pos)
  else
    body = string.format('{"subject":"%s"}', t[2])
  end
  inflight = inflight + 1
  return wrk.format("POST", "/v1/tokens/" .. t[1] .. "/consume", auth_headers, body)
end

-- the peer's lock on a started key, and how long it keeps a response
local PEER_LOCK_MS = 30000
local PEER_TTL_MS = 86400000

local function key_request()
  if complete and #pending > 0 then
    inflight = inflight + 1
    local k = table.remove(pending)
    if peer then
      return wrk.format("POST", "/api/v1.idempotency.complete", auth_headers,
        string.format('{"key":"%s","response":"{\\"ok\\":true}","ttl_ms":%d}', k, PEER_TTL_MS))
    end
    return wrk.format("POST", "/v1/keys/result", auth_headers,
      string.format('{"biz_type":"%s","key":"%s","result":{"ok":true}}', biz_list[1], k))
  end
  if key_style == "prepare" and seq >= key_count then
    -- every key claimed: stop once the last results are answered
    if inflight == 0 then exhausted = true end
    return filler()
  end
  inflight = inflight + 1
  seq = seq + 1
  local n = seq
  if key_style == "replay" then n = (seq - 1) % key_count + 1 end
  local k = string.format("%s-%d-%d", id_tag, tid, n)
  if peer then
    sent_tail = sent_tail + 1
    sent[sent_tail] = k
    return wrk.format("POST", "/api/v1.idempotency.start", auth_headers,
      string.format('{"key":"%s","lock_period_ms":%d}', k, PEER_LOCK_MS))
  end
  if key_style == "replay" then
    return wrk.format("POST", "/v1/keys/consume", auth_headers,
      string.format('{"biz_type":"%s","key":"%s"}', biz_list[1], k))
  end
  return wrk.format("POST", "/v1/keys/consume", auth_headers,
    string.format('{"biz_type":"%s","key":"%s","request_id":"r%d-%d"}',
      biz_list[1], k, tid, seq))
end

-- The peer's answers: start is {"status":"started"|"locked"|"completed",...},
-- complete is {}. They do not name the key, so each start answer is taken
-- for the oldest start of this thread not answered yet (its keys are new,
-- so no key is counted twice: `doubles` stays 0 by construction here).
local function on_peer_key(status, body)
  if status ~= 200 then
    inc("unexpected"); inc("status_" .. status)
    return
  end
  local st = body:match('"status":"(%a+)"')
  local k = nil
  if st ~= nil and sent_head <= sent_tail then
    k = sent[sent_head]
    sent[sent_head] = nil
    sent_head = sent_head + 1
  end
  if st == nil and body:match("^%s*{%s*}%s*$") then
    inc("ok"); inc("completed")
  elseif st == "started" and k then
    inc("ok"); inc("consumed")
    if complete then pending[#pending + 1] = k end
  elseif st == "completed" then
    inc("ok"); inc("duplicate"); inc("duplicate_completed")
  elseif st == "locked" then
    inc("ok"); inc("duplicate"); inc("duplicate_processing")
  else
    inc("unexpected")
  end
end

-- one base64url character of the tag changed: the text stays canonical and
-- well-formed, so only the HMAC comparison can refuse it
local function forge(t)
  local i = #t - 10
  local c = t:sub(i, i)
  local r = (c == "A") and "B" or "A"
  return t:sub(1, i - 1) .. r .. t:sub(i + 1)
end

local checked = false

function request()
  -- wrk calls request() once on its first thread before any connection is
  -- made, to check what it returns, and never sends it: that call must not
  -- take a token or a key (nor count as in flight), or the thread would
  -- skip one and never see all its answers.
  if tid == 0 and not checked then
    checked = true
    return filler()
  end
  if mode == "issue" then
    return issue_request()
  elseif mode == "consume" then
    return consume_request()
  elseif mode == "mixed" then
    seq = seq + 1
    if seq % 5 == 0 then return issue_request() end
    return consume_request()
  elseif mode == "keys" or mode == "dkeys" then
    return key_request()
  elseif mode == "forged" then
    pos = pos % #tokens + 1
    local t = tokens[pos]
    return wrk.format("POST", "/v1/tokens/" .. forge(t[1]) .. "/consume", auth_headers,
      string.format('{"subject":"%s"}', t[2]))
  elseif mode == "pay" then
    local t = next_token()
    if not t then return filler() end
    inflight = inflight + 1
    return wrk.format("POST", "/v1/orders/" .. t[3] .. "/pay", auth_headers,
      string.format('{"token":"%s","request_id":"p%d-%d"}', t[1], tid, pos))
  elseif mode == "seq" then
    seq = seq + 1
    return wrk.format("GET", string.format("%s%s-%d-%d", path_prefix, id_tag, tid, seq), get_headers)
  else
    return wrk.format("GET", path_prefix, get_headers)
  end
end

local function header(headers, name)
  return headers[name] or headers[name:lower()]
end

local function on_issue(status, body)
  if status ~= 201 then
    inc("unexpected"); inc("status_" .. status)
    return
  end
  local t = body:match('"token":"([^"]+)"')
  local s = body:match('"subject":"([^"]+)"')
  local b = body:match('"biz_type":"([^"]+)"')
  if not (t and s and b) then inc("unexpected"); return end
  inc("ok"); inc("issued")
  local out = _G["issued_" .. b]
  if not out then
    out = {}
    _G["issued_" .. b] = out
    issued_bizs = issued_bizs .. b .. ","
  end
  out[#out + 1] = t .. " " .. s
  if limit and counters.issued >= limit then wrk.thread:stop() end
end

local function on_consume(status, headers, body)
  if status ~= 200 then
    inc("unexpected"); inc("status_" .. status)
    return
  end
  local o = body:match('"outcome":"(%a+)"')
  if o == "consumed" then
    if header(headers, "Idempotent-Replayed") then
      inc("ok"); inc("replayed")
      return
    end
    -- a key's answer carries "key" where a token's carries "token"
    local t = body:match('"token":"([^"]+)"') or body:match('"key":"([^"]+)"')
    if not t then inc("unexpected"); return end
    inc("ok"); inc("consumed")
    local n = (seen[t] or 0) + 1
    seen[t] = n
    if n == 2 then inc("doubles") end
    if complete then pending[#pending + 1] = t end
  elseif o == "duplicate" then
    inc("ok"); inc("duplicate")
    local st = body:match('"status":"(%a+)"')
    if st then inc("duplicate_" .. st) end
  else
    inc("unexpected")
  end
end

local HEALTHZ = '{"status":"ok"}'
local PEER_PING = '{"ok":true}'

function response(status, headers, body)
  -- (the prepare runs send fillers before the last results are answered)
  local is_filler = body == HEALTHZ or (peer and body == PEER_PING)
  if is_filler then
    inc("filler")
  else
    inflight = inflight - 1
  end
  if is_filler then
    -- nothing to check
  elseif mode == "issue" then
    on_issue(status, body)
  elseif mode == "consume" then
    on_consume(status, headers, body)
  elseif mode == "mixed" then
    if status == 201 then on_issue(status, body) else on_consume(status, headers, body) end
  elseif mode == "dkeys" then
    on_peer_key(status, body)
  elseif mode == "keys" then
    if status == 200 and body:find('"outcome":"recorded"', 1, true) then
      inc("ok"); inc("completed")
    else
      on_consume(status, headers, body)
    end
  elseif mode == "forged" then
    if status == 400 and body:find('"token_invalid"', 1, true) then
      inc("ok"); inc("refused")
    else
      inc("unexpected"); inc("status_" .. status)
    end
  elseif mode == "pay" then
    local o = body:match('"outcome":"(%a+)"')
    if status == 200 and o == "applied" and not header(headers, "Idempotent-Replayed") then
      inc("ok"); inc("consumed")
      local t = body:match('"order_id":"([^"]+)"')
      local n = (seen[t] or 0) + 1
      seen[t] = n
      if n == 2 then inc("doubles") end
    elseif status == 200 then
      inc("ok"); inc("pay_" .. (o or "other"))
    else
      inc("unexpected"); inc("status_" .. status)
    end
  else
    if status >= 200 and status < 300 then inc("ok") else inc("unexpected"); inc("status_" .. status) end
    if mode == "seq" then
      if body == "1" then inc("hit") elseif body == "0" then inc("miss") end
    end
  end
  -- out of tokens: stop once every token request has its answer
  if exhausted and inflight <= 0 and not stopping then
    stopping = true
    wrk.thread:stop()
  end
end

function done(summary, latency, requests)
  local total = {}
  for _, t in ipairs(threads) do
    local c = t:get("counters") or {}
    for k, v in pairs(c) do
      if type(v) == "number" and k ~= "tid" then total[k] = (total[k] or 0) + v end
    end
    -- the tokens a thread was issued, one file per (biz type, thread)
    local id = t:get("tid")
    local d = t:get("dir")
    for b in string.gmatch(t:get("issued_bizs") or "", "[^,]+") do
      local lines = t:get("issued_" .. b) or {}
      local f = assert(io.open(string.format("%s/tok-%s-%d", d, b, id), "a"))
      if #lines > 0 then f:write(table.concat(lines, "\n"), "\n") end
      f:close()
    end
  end
  local parts = {}
  for k, v in pairs(total) do table.insert(parts, string.format('"%s":%d', k, v)) end
  local e = summary.errors
  io.write(string.format(
    'BENCHJSON {"duration_us":%d,"requests":%d,"bytes":%d,' ..
    '"socket_errors":{"connect":%d,"read":%d,"write":%d,"timeout":%d},"non_2xx":%d,' ..
    '"latency_us":{"mean":%.1f,"p50":%d,"p90":%d,"p99":%d,"p999":%d,"max":%d},' ..
    '"counters":{%s}}\n',
    summary.duration, summary.requests, summary.bytes,
    e.connect, e.read, e.write, e.timeout, e.status,
    latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max,
    table.concat(parts, ",")))
end
