#include "lattice/parallel/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <sstream>

#include "lattice/core/error.h"
#include "lattice/parallel/pipeline/simulator.h"

namespace lattice::pipeline {

// The letters of Op, in its order.
static constexpr char kOpLetters[] = "FBIW";

char op_letter(Op op) { return kOpLetters[static_cast<int>(op)]; }

std::string to_string(const Action& a) { return std::to_string(a.stage) + op_letter(a.op) + std::to_string(a.micro); }

Action parse_action(std::string_view cell, const std::string& where) {
  // <stage digits><F|B|I|W><micro-batch digits>
  size_t i = 0;
  auto digits = [&](int* out) {
    const size_t start = i;
    int64_t v = 0;
    while (i < cell.size() && std::isdigit(static_cast<unsigned char>(cell[i])) && i - start < 9)
      v = v * 10 + (cell[i++] - '0');
    *out = static_cast<int>(v);
    return i > start;
  };
  Action a;
  bool ok = digits(&a.stage) && i < cell.size();
  if (ok) {
    const char* letter = std::strchr(kOpLetters, cell[i++]);
    ok = letter && *letter != '\0';
    if (ok) a.op = static_cast<Op>(letter - kOpLetters);
  }
  ok = ok && digits(&a.micro) && i == cell.size();
  LATTICE_CHECK(ok, where << ": '" << std::string(cell)
                          << "' is not an action (expected <stage><F|B|I|W><micro-batch>, e.g. 1F3; "
                             "F forward, B full backward, I input backward, W weight backward)");
  return a;
}

// ---- generators ----

static void check_sizes(const char* name, int p, int v, int m) {
  LATTICE_CHECK(p >= 1, name << " schedule: needs at least one rank, got p=" << p);
  LATTICE_CHECK(v >= 1, name << " schedule: needs at least one chunk per rank, got v=" << v);
  LATTICE_CHECK(m >= 1, name << " schedule: needs at least one micro-batch, got m=" << m);
}

static Schedule empty_schedule(const std::string& name, int p, int v, int m) {
  Schedule s;
  s.name = name;
  s.ranks = p;
  s.stages = p * v;
  s.micro_batches = m;
  s.actions.assign(static_cast<size_t>(p), {});
  s.rank_of_stage.resize(static_cast<size_t>(p * v));
  for (int st = 0; st < p * v; st++) s.rank_of_stage[st] = st % p;  // stage c·p + r on rank r
  return s;
}

Schedule gpipe(int p, int m) {
  check_sizes("gpipe", p, 1, m);
  Schedule s = empty_schedule("gpipe", p, 1, m);
  for (int r = 0; r < p; r++) {
    for (int k = 0; k < m; k++) s.actions[r].push_back({r, Op::F, k});
    for (int k = 0; k < m; k++) s.actions[r].push_back({r, Op::B, k});
  }
  return s;
}

// The 1F1B order over `total` items of a rank: `warmup` forwards, then one
// forward and one backward alternately, then the remaining backwards (the
// drain). forward(k) and backward(k, drain) append item k's actions.
template <typename Forward, typename Backward>
static void one_f_one_b_order(int total, int warmup, Forward forward, Backward backward) {
  for (int k = 0; k < warmup; k++) forward(k);
  for (int k = 0; k < total - warmup; k++) {
    forward(warmup + k);
    backward(k, false);
  }
  for (int k = total - warmup; k < total; k++) backward(k, true);
}

Schedule one_f_one_b(int p, int m) {
  check_sizes("1f1b", p, 1, m);
  Schedule s = empty_schedule("1f1b", p, 1, m);
  for (int r = 0; r < p; r++) {
    std::vector<Action>& a = s.actions[r];
    one_f_one_b_order(
        m, std::min(p - 1 - r, m),
        [&](int k) {
          a.push_back({r, Op::F, k});
        },
        [&](int k, bool) {
          a.push_back({r, Op::B, k});
        });
  }
  return s;
}

Schedule interleaved_1f1b(int p, int v, int m) {
  check_sizes("interleaved", p, v, m);
  LATTICE_CHECK(
      v >= 2, "interleaved schedule: needs parallel.virtual_stages >= 2 chunks per rank, got " << v << " (1 is 1f1b)");
  LATTICE_CHECK(m % p == 0, "interleaved schedule: the micro-batches per step ("
                                << m << ") must be a multiple of parallel.pp=" << p
                                << " (the schedule runs them in groups of p per chunk)");
  Schedule s = empty_schedule("interleaved", p, v, m);
  const int total = m * v;  // chunk-micro-batches per rank
  // Virtual index k: groups of p micro-batches go through chunk 0, then chunk
  // 1, ...; backwards visit the chunks in reverse.
  auto micro_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  for (int r = 0; r < p; r++) {
    std::vector<Action>& a = s.actions[r];
    one_f_one_b_order(
        total, std::min((p - r - 1) * 2 + (v - 1) * p, total),
        [&](int k) {
          a.push_back({((k / p) % v) * p + r, Op::F, micro_of(k)});
        },
        [&](int k, bool) {
          a.push_back({(v - 1 - (k / p) % v) * p + r, Op::B, micro_of(k)});
        });
  }
  return s;
}

Schedule zb_h1(int p, int m) {
  check_sizes("zb-h1", p, 1, m);
  Schedule s = empty_schedule("zb-h1", p, 1, m);
  for (int r = 0; r < p; r++) {
    std::vector<Action>& a = s.actions[r];
    std::vector<int> pending;  // micro-batches whose W is still to run, oldest first
    size_t oldest = 0;
    auto weight = [&] { a.push_back({r, Op::W, pending[oldest++]}); };
    auto deferred = [&] { return static_cast<int>(pending.size() - oldest); };
    // 1F1B's order with each B split: I in B's place; rank r keeps r weight
    // passes back, and in the drain runs one W after each I, filling the wait
    // for the next.
    one_f_one_b_order(
        m, std::min(p - 1 - r, m),
        [&](int k) {
          a.push_back({r, Op::F, k});
        },
        [&](int k, bool drain) {
          a.push_back({r, Op::I, k});
          pending.push_back(k);
          if (drain) {
            weight();
          } else {
            while (deferred() > r) weight();
          }
        });
    while (deferred() > 0) weight();
  }
  return s;
}

// ZB-V by list scheduling at unit costs. The ranks are simulated together
// in time order; whenever a rank is free it runs, of the actions whose inputs
// have arrived: the oldest micro-batch's input backward I (the chain everyone
// downstream waits for), else the next forward of chunk 1 (the return leg of
// the V, which starts that micro-batch's backward), else the next forward of
// chunk 0. With none of them ready it runs a deferred W — unless an action
// whose input is already on its way would arrive before the W ends (a W must
// not delay the critical path) — or waits.
//
// Memory: a chunk's activations are held from its F to its W, at most 2p
// chunks per rank (p stage equivalents, 1F1B's peak). A forward of chunk 0
// starts a micro-batch that this rank must later also run through chunk 1,
// so it is admitted only while the held chunks plus those reserved return
// forwards stay within 2p (less `slack` of the reservation: looser variants
// can fill the warm-up better, or deadlock, which is detected). Returns false
// on a deadlock; fills `out` (stages already placed) otherwise.
static bool zb_v_attempt(int p, int m, int slack, Schedule* out, double* makespan) {
  const int S = 2 * p, limit = 2 * p, per_rank = 6 * m;  // F, I, W of two chunks
  auto idx = [m](int stage, int micro) { return static_cast<size_t>(stage) * m + micro; };
  std::vector<double> f_end(static_cast<size_t>(S) * m, -1), i_end(static_cast<size_t>(S) * m, -1);
  // When action (stage, F or I, micro)'s inputs are ready; -1 while a dependency is unscheduled.
  auto ready_at = [&](int stage, Op op, int k) -> double {
    if (op == Op::F) return stage == 0 ? 0.0 : f_end[idx(stage - 1, k)];
    const double f = f_end[idx(stage, k)];
    if (f < 0 || stage == S - 1) return f;
    const double g = i_end[idx(stage + 1, k)];
    return g < 0 ? -1 : std::max(f, g);
  };
  struct RankState {
    double free = 0, stuck = -1;  // stuck: found nothing to do at this time, let the others go first
    int next_f[2] = {0, 0}, next_i[2] = {0, 0};
    int held = 0, done = 0;
    std::vector<Action> weights;  // deferred W, oldest first
    size_t oldest = 0;
  };
  std::vector<RankState> ranks(static_cast<size_t>(p));
  struct Candidate {
    Op op;
    int chunk, micro;
    double ready;
  };
  *makespan = 0;
  for (int64_t remaining = static_cast<int64_t>(p) * per_rank; remaining > 0;) {
    int r = -1;  // the free rank earliest in time (not yet stuck there), lowest index first
    for (int x = 0; x < p; x++) {
      const RankState& c = ranks[x];
      if (c.done == per_rank) continue;
      if (r < 0 || c.free < ranks[r].free || (c.free == ranks[r].free && c.stuck != c.free && ranks[r].stuck == ranks[r].free))
        r = x;
    }
    RankState& me = ranks[r];
    const double t = me.free;
    const int stage[2] = {r, S - 1 - r};
    std::vector<Candidate> cands;
    for (int c = 1; c >= 0; c--)
      if (me.next_i[c] < me.next_f[c]) cands.push_back({Op::I, c, me.next_i[c], ready_at(stage[c], Op::I, me.next_i[c])});
    for (int c = 1; c >= 0; c--) {
      if (me.next_f[c] == m) continue;
      const int reserve = c == 0 ? std::max(1, me.next_f[0] + 1 - me.next_f[1] - slack) : 1;
      if (me.held + reserve <= limit) cands.push_back({Op::F, c, me.next_f[c], ready_at(stage[c], Op::F, me.next_f[c])});
    }
    const Candidate* pick = nullptr;
    double soon = -1;  // the earliest known arrival of a candidate's input
    for (const Candidate& c : cands) {
      if (c.ready >= 0 && c.ready <= t) {
        const bool better = !pick || (c.op == Op::I && pick->op != Op::I) ||
                            (c.op == Op::I && pick->op == Op::I && c.micro < pick->micro);
        if (better) pick = &c;
      } else if (c.ready >= 0 && (soon < 0 || c.ready < soon)) {
        soon = c.ready;
      }
    }
    const bool weight_waits = me.oldest < me.weights.size();
    if (!pick && weight_waits && (soon < 0 || soon >= t + 1)) {
      out->actions[r].push_back(me.weights[me.oldest++]);
      me.held--;
      me.free = t + 1;
    } else if (pick) {
      const int st = stage[pick->chunk];
      out->actions[r].push_back({st, pick->op, pick->micro});
      me.free = t + 1;
      if (pick->op == Op::F) {
        f_end[idx(st, pick->micro)] = me.free;
        me.next_f[pick->chunk]++;
        me.held++;
      } else {
        i_end[idx(st, pick->micro)] = me.free;
        me.next_i[pick->chunk]++;
        me.weights.push_back({st, Op::W, pick->micro});
      }
    } else if (soon >= 0) {
      me.free = soon;  // wait for the input on its way
      continue;
    } else {
      // Nothing known to arrive: let the other ranks free at this time go
      // first, else wait until some rank is free again.
      bool others = false;
      double later = -1;
      for (int x = 0; x < p; x++) {
        const RankState& c = ranks[x];
        if (x == r || c.done == per_rank) continue;
        if (c.free == t && c.stuck != t) others = true;
        if (c.free > t && (later < 0 || c.free < later)) later = c.free;
      }
      if (others) {
        me.stuck = t;
      } else if (later >= 0) {
        me.free = later;
      } else {
        return false;  // every rank waits for another
      }
      continue;
    }
    me.done++;
    remaining--;
    *makespan = std::max(*makespan, me.free);
  }
  return true;
}

Schedule zb_v(int p, int m) {
  check_sizes("zb-v", p, 2, m);
  Schedule best;
  double best_makespan = 0;
  for (int slack = 0; slack <= 2; slack++) {
    Schedule s = empty_schedule("zb-v", p, 2, m);
    for (int st = p; st < 2 * p; st++) s.rank_of_stage[st] = 2 * p - 1 - st;  // the V: chunk 1 comes back up
    double makespan = 0;
    if (zb_v_attempt(p, m, slack, &s, &makespan) && (best.actions.empty() || makespan < best_makespan)) {
      best = std::move(s);
      best_makespan = makespan;
    }
  }
  LATTICE_CHECK(!best.actions.empty(), "internal: no ZB-V schedule for p=" << p << ", m=" << m);
  return best;
}

Schedule make_schedule(const std::string& name, int p, int v, int m) {
  if (name == "gpipe" || name == "1f1b" || name == "zb-h1") {
    LATTICE_CHECK(v == 1, name << " schedule: one chunk per rank (parallel.virtual_stages=1), got " << v
                               << "; the interleaved schedule runs several");
    return name == "gpipe" ? gpipe(p, m) : name == "1f1b" ? one_f_one_b(p, m) : zb_h1(p, m);
  }
  if (name == "interleaved") return interleaved_1f1b(p, v, m);
  if (name == "zb-v") {
    LATTICE_CHECK(v == 2, "zb-v schedule: two chunks per rank (parallel.virtual_stages=2), got "
                              << v << "; the V places stage r and stage 2p-1-r on rank r");
    return zb_v(p, m);
  }
  LATTICE_FAIL("unknown pipeline schedule '" << name << "' (known: gpipe, 1f1b, interleaved, zb-h1, zb-v)");
}

// ---- CSV ----

std::string to_csv(const Schedule& s) {
  std::string out;
  for (const std::vector<Action>& row : s.actions) {
    for (size_t i = 0; i < row.size(); i++) out += (i ? "," : "") + to_string(row[i]);
    out += "\n";
  }
  return out;
}

Schedule from_csv(const std::string& text, const std::string& source) {
  Schedule s;
  s.name = source;
  std::istringstream in(text);
  std::string line;
  int row = 0;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    row++;
    std::vector<Action> actions;
    size_t col = 0, begin = 0;
    while (begin <= line.size()) {
      size_t end = line.find(',', begin);
      if (end == std::string::npos) end = line.size();
      std::string cell = line.substr(begin, end - begin);
      cell.erase(0, cell.find_first_not_of(" \t"));
      cell.erase(cell.find_last_not_of(" \t") + 1);
      col++;
      if (!cell.empty())
        actions.push_back(parse_action(cell, source + " row " + std::to_string(row) + " (rank " +
                                                 std::to_string(row - 1) + ") column " + std::to_string(col)));
      begin = end + 1;
    }
    s.actions.push_back(std::move(actions));
  }
  while (!s.actions.empty() && s.actions.back().empty()) s.actions.pop_back();  // trailing blank lines
  LATTICE_CHECK(!s.actions.empty(), source << ": no schedule (expected one row of actions per rank)");
  s.ranks = static_cast<int>(s.actions.size());
  for (const auto& r : s.actions)
    for (const Action& a : r) {
      s.stages = std::max(s.stages, a.stage + 1);
      s.micro_batches = std::max(s.micro_batches, a.micro + 1);
    }
  s.rank_of_stage.assign(static_cast<size_t>(s.stages), -1);
  for (int r = 0; r < s.ranks; r++)
    for (const Action& a : s.actions[r]) {
      int& owner = s.rank_of_stage[a.stage];
      LATTICE_CHECK(owner < 0 || owner == r, source << ": action " << to_string(a) << " on rank " << r << " but stage "
                                                    << a.stage << " is on rank " << owner
                                                    << " (each stage lives on one rank)");
      owner = r;
    }
  for (int st = 0; st < s.stages; st++)
    LATTICE_CHECK(s.rank_of_stage[st] >= 0, source << ": stage " << st << " has no action on any rank (stages "
                                                   << "0.." << s.stages - 1 << " are named)");
  return s;
}

// ---- validation ----

void validate_structure(const Schedule& s) {
  const std::string who = "schedule " + s.name;
  LATTICE_CHECK(s.ranks >= 1 && static_cast<int>(s.actions.size()) == s.ranks,
                who << ": " << s.actions.size() << " rows of actions for " << s.ranks << " ranks");
  LATTICE_CHECK(s.stages >= s.ranks && s.micro_batches >= 1 && static_cast<int>(s.rank_of_stage.size()) == s.stages,
                who << ": needs at least one stage per rank and one micro-batch (" << s.stages << " stages, "
                    << s.micro_batches << " micro-batches, " << s.ranks << " ranks)");
  // Per (stage, micro-batch): where each kind of action sits (rank, position), -1 if absent.
  struct Seen {
    int pos[4] = {-1, -1, -1, -1};
  };
  std::vector<Seen> seen(static_cast<size_t>(s.stages) * s.micro_batches);
  for (int r = 0; r < s.ranks; r++)
    for (size_t i = 0; i < s.actions[r].size(); i++) {
      const Action& a = s.actions[r][i];
      const std::string at =
          who + ": rank " + std::to_string(r) + " action " + std::to_string(i + 1) + " '" + to_string(a) + "'";
      LATTICE_CHECK(a.stage >= 0 && a.stage < s.stages, at << ": stage outside 0.." << s.stages - 1);
      LATTICE_CHECK(a.micro >= 0 && a.micro < s.micro_batches,
                    at << ": micro-batch outside 0.." << s.micro_batches - 1);
      LATTICE_CHECK(s.rank_of_stage[a.stage] == r,
                    at << ": stage " << a.stage << " lives on rank " << s.rank_of_stage[a.stage]);
      Seen& e = seen[static_cast<size_t>(a.stage) * s.micro_batches + a.micro];
      int& pos = e.pos[static_cast<int>(a.op)];
      LATTICE_CHECK(pos < 0, at << ": appears twice (first as action " << pos + 1 << ")");
      pos = static_cast<int>(i);
      const int f = e.pos[static_cast<int>(Op::F)], b = e.pos[static_cast<int>(Op::B)],
                in = e.pos[static_cast<int>(Op::I)], w = e.pos[static_cast<int>(Op::W)];
      if (a.op != Op::F)
        LATTICE_CHECK(f >= 0, at << ": a backward before its forward " << a.stage << "F" << a.micro << " on this rank");
      if (a.op == Op::W)
        LATTICE_CHECK(in >= 0, at << ": a weight backward before its input backward " << a.stage << "I" << a.micro);
      LATTICE_CHECK(!(b >= 0 && (in >= 0 || w >= 0)), at << ": stage " << a.stage << " micro-batch " << a.micro
                                                         << " has both a full backward (B) and a split one (I/W)");
    }
  for (int st = 0; st < s.stages; st++)
    for (int k = 0; k < s.micro_batches; k++) {
      const Seen& e = seen[static_cast<size_t>(st) * s.micro_batches + k];
      const std::string what = who + ": stage " + std::to_string(st) + " micro-batch " + std::to_string(k) + " (rank " +
                               std::to_string(s.rank_of_stage[st]) + ")";
      LATTICE_CHECK(e.pos[static_cast<int>(Op::F)] >= 0, what << " has no forward " << st << "F" << k);
      const bool full = e.pos[static_cast<int>(Op::B)] >= 0, input = e.pos[static_cast<int>(Op::I)] >= 0,
                 weight = e.pos[static_cast<int>(Op::W)] >= 0;
      LATTICE_CHECK(full || input, what << " has no backward (" << st << "B" << k << ", or " << st << "I" << k
                                        << " and " << st << "W" << k << ")");
      LATTICE_CHECK(full || weight,
                    what << " has no weight backward " << st << "W" << k << " after its " << st << "I" << k);
    }
}

void validate(const Schedule& s) {
  validate_structure(s);
  simulate(s, Costs{});  // throws naming the blocked action on a deadlock
}

}  // namespace lattice::pipeline
