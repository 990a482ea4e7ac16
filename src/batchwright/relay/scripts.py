"""The relay's Lua scripts: each runs atomically in Redis, so two workers never take the
same request and two reapers never hand the same request back twice.

They name keys derived from a request (its events, its model's pending list) inside the
script, as a single Redis (not a cluster) allows.
"""

from __future__ import annotations

# KEYS: taken, pending_1..pending_n, bell_1..bell_n. ARGV: n.
# The first request of the first model with one, moved to the worker's taken list. With
# none, the bells of these models are stale (a submit pushes request and bell together)
# and are cleared, so an idle worker does not wake for requests already gone.
TAKE = """
local n = tonumber(ARGV[1])
for i = 1, n do
  local item = redis.call('LMOVE', KEYS[1 + i], KEYS[1], 'RIGHT', 'LEFT')
  if item then return item end
end
for i = 1, n do redis.call('DEL', KEYS[1 + n + i]) end
return false
"""

# KEYS: serving set of a model. ARGV: key prefix. -> {live workers, dead workers}.
MEMBERS = """
local live, dead = {}, {}
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', ARGV[1] .. ':worker:' .. w) == 1 then
    table.insert(live, w)
  else
    table.insert(dead, w)
  end
end
return {live, dead}
"""

# KEYS: the worker's liveness key, its taken list. ARGV: prefix, worker id, max requeues,
# events TTL (s), error message, serving sets to leave (the rest of ARGV).
# A dead worker's requests: one it never announced goes back to the head of its model's
# pending list (at most max requeues times: a request that kills its workers must end),
# one it started gets a `worker_lost` error event; cancelled ones are dropped.
# -> {requeued, lost}, or -1 when the worker is alive after all.
REAP = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local prefix, worker = ARGV[1], ARGV[2]
local max_requeues, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local requeued, lost = 0, 0
local function fail(req, events, message)
  local event = cjson.encode({type = 'error', worker = worker, attempt = req['attempt'],
    status = 503, error = {message = message, type = 'server_error', param = cjson.null,
    code = 'worker_lost'}})
  redis.call('XADD', events, '*', 'e', event)
  redis.call('EXPIRE', events, ttl)
  lost = lost + 1
end
for _, raw in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  local req = cjson.decode(raw)
  local id = req['id']
  local events = prefix .. ':events:' .. id
  if redis.call('EXISTS', prefix .. ':cancel:' .. id) == 0 then
    local started = false
    local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)
    if #last == 1 then
      local ev = cjson.decode(last[1][2][2])
      started = ev['worker'] == worker and ev['attempt'] == req['attempt']
    end
    if started then
      fail(req, events, ARGV[5])
    else
      local count = redis.call('INCR', prefix .. ':requeues:' .. id)
      redis.call('EXPIRE', prefix .. ':requeues:' .. id, ttl)
      if count > max_requeues then
        fail(req, events, 'The request was lost with ' .. count .. ' workers in a row.')
      else
        redis.call('RPUSH', prefix .. ':pending:' .. req['model'], raw)
        redis.call('LPUSH', prefix .. ':bell:' .. req['model'], '1')
        requeued = requeued + 1
      end
    end
  end
end
redis.call('DEL', KEYS[2])
for i = 6, #ARGV do redis.call('SREM', ARGV[i], worker) end
return {requeued, lost}
"""
