#include "lattice/parallel/pipeline/executor.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include "lattice/core/error.h"
#include "lattice/core/timer.h"
#include "lattice/kernels/ops.h"

namespace lattice::pipeline {

namespace {

// A message between stages: produced by `stage` for micro-batch `micro`,
// forward (its output activation) or backward (its input's gradient).
struct Key {
  int stage, micro;
  bool backward;
  bool operator<(const Key& o) const {
    return std::tie(stage, micro, backward) < std::tie(o.stage, o.micro, o.backward);
  }
};

}  // namespace

struct Executor::Pending {
  std::vector<float> data;
  comm::WorkPtr work;  // null once complete (or for a local copy)
};

Executor::Executor(const Schedule& schedule, std::vector<model::GPT*> stages, comm::Communicator& group)
    : schedule_(schedule), group_(group) {
  validate(schedule_);
  const int me = group.rank(), S = schedule_.stages;
  LATTICE_CHECK(group.size() == schedule_.ranks, "pipeline schedule " << schedule_.name << " has " << schedule_.ranks
                                                                      << " ranks but the pipeline group has "
                                                                      << group.size());
  stage_of_.assign(static_cast<size_t>(S), nullptr);
  size_t j = 0;
  for (int s = 0; s < S; s++) {
    if (schedule_.rank_of_stage[s] != me) continue;
    LATTICE_CHECK(j < stages.size(), "rank " << me << " holds more stages of schedule " << schedule_.name
                                             << " than the " << stages.size() << " models it was given");
    model::GPT* m = stages[j++];
    LATTICE_CHECK(m->first_stage() == (s == 0) && m->last_stage() == (s == S - 1),
                  "stage " << s << " of " << S << " was given the model of layers [" << m->first_layer() << ", "
                           << m->last_layer() << ")");
    stage_of_[s] = m;
  }
  LATTICE_CHECK(j == stages.size(), "rank " << me << " was given " << stages.size() << " stage models but holds " << j
                                            << " stages of schedule " << schedule_.name);
  const int first = schedule_.rank_of_stage[0], last = schedule_.rank_of_stage[S - 1];
  if (first != last)
    embedding_group_ = group.split(me == first || me == last ? 0 : -1, me, group.name() + ".embedding");
}

Executor::~Executor() = default;

model::GPT& Executor::stage_model(int stage) {
  LATTICE_CHECK(stage_of_[stage], "internal: stage " << stage << " is not on this rank");
  return *stage_of_[stage];
}

int Executor::tag(int stage, int micro, bool backward) const {
  const int64_t t =
      (static_cast<int64_t>(backward ? 1 : 0) * schedule_.stages + stage) * schedule_.micro_batches + micro;
  LATTICE_CHECK(t < 32767, "pipeline: " << schedule_.stages << " stages x " << schedule_.micro_batches
                                        << " micro-batches need more message tags than MPI guarantees (32767)");
  return static_cast<int>(t);
}

double Executor::run_step(const std::vector<MicroBatch>& batches, int B, int T) {
  const int m = schedule_.micro_batches;
  LATTICE_CHECK(static_cast<int>(batches.size()) == m,
                "pipeline step: " << batches.size() << " micro-batches for a schedule of " << m);
  double loss = run_actions(schedule_.actions[group_.rank()], batches, B, T, true);
  group_.all_reduce(&loss, 1, DType::F64, comm::ReduceOp::Sum);  // only the last stage adds
  return loss / m;
}

double Executor::evaluate(const std::vector<MicroBatch>& batches, int B, int T) {
  std::vector<Action> forwards;
  for (int k = 0; k < static_cast<int>(batches.size()); k++)
    for (int s = 0; s < schedule_.stages; s++)
      if (stage_of_[s]) forwards.push_back({s, Op::F, k});
  for (model::GPT* g : stage_of_)
    if (g) g->set_evaluation(true);
  double loss = 0;
  try {
    loss = run_actions(forwards, batches, B, T, false);
  } catch (...) {
    for (model::GPT* g : stage_of_)
      if (g) g->set_evaluation(false);
    throw;
  }
  for (model::GPT* g : stage_of_)
    if (g) g->set_evaluation(false);
  group_.all_reduce(&loss, 1, DType::F64, comm::ReduceOp::Sum);
  return loss / static_cast<double>(batches.size());
}

double Executor::run_actions(const std::vector<Action>& actions, const std::vector<MicroBatch>& batches, int B, int T,
                             bool training) {
  const int me = group_.rank(), S = schedule_.stages;
  const int m = static_cast<int>(batches.size());
  const int64_t N = static_cast<int64_t>(B) * T;
  int64_t rows = 0, C = 0;
  for (model::GPT* g : stage_of_)
    if (g) C = g->config().n_embd, rows = g->stage_rows(N);
  const size_t count = static_cast<size_t>(rows * C);  // one activation or gradient (this rank's rows under SP)

  std::map<Key, Pending> mailbox;  // messages received or handed over on this rank
  std::vector<Pending> sends;
  std::vector<std::vector<int>> free_slots(static_cast<size_t>(S));
  std::vector<std::vector<int>> slot_of(static_cast<size_t>(S), std::vector<int>(static_cast<size_t>(m), -1));
  std::vector<int> slots_made(static_cast<size_t>(S), 0);

  // The message action a needs from another stage, if any.
  auto needs = [&](const Action& a, Key* key) {
    if (a.op == Op::F && a.stage > 0) {
      *key = {a.stage - 1, a.micro, false};
      return true;
    }
    if ((a.op == Op::B || a.op == Op::I) && a.stage < S - 1) {
      *key = {a.stage + 1, a.micro, true};
      return true;
    }
    return false;
  };
  auto post_receive = [&](const Key& key) {
    if (mailbox.count(key)) return;
    const int from = schedule_.rank_of_stage[key.stage];
    if (from == me) return;  // handed over locally when produced
    Pending& p = mailbox[key];
    p.data.resize(count);
    p.work = group_.irecv(p.data.data(), count, DType::F32, from, tag(key.stage, key.micro, key.backward));
  };
  auto take = [&](const Key& key) -> std::vector<float> {
    auto it = mailbox.find(key);
    LATTICE_CHECK(it != mailbox.end(), "pipeline: rank " << me << " has no message from stage " << key.stage
                                                         << " micro-batch " << key.micro);
    if (it->second.work) it->second.work->wait();
    std::vector<float> data = std::move(it->second.data);
    mailbox.erase(it);
    return data;
  };
  auto deliver = [&](const Key& key, const float* data, int to_stage) {
    const int to = schedule_.rank_of_stage[to_stage];
    Pending p;
    p.data.assign(data, data + count);
    if (to == me) {
      mailbox[key] = std::move(p);
    } else {
      p.work = group_.isend(p.data.data(), count, DType::F32, to, tag(key.stage, key.micro, key.backward));
      sends.push_back(std::move(p));
    }
  };

  // Where each stage's last backward is in the list.
  std::vector<size_t> last_backward(static_cast<size_t>(S), actions.size());
  for (size_t i = 0; i < actions.size(); i++)
    if (actions[i].op == Op::B || actions[i].op == Op::W) last_backward[actions[i].stage] = i;

  timeline_.clear();
  Timer clock;
  double loss_sum = 0;
  for (size_t i = 0; i < actions.size(); i++) {
    const Action& a = actions[i];
    // Receives for this action and the next are posted now (early); this one is waited for below.
    for (size_t j = i; j < std::min(actions.size(), i + 2); j++) {
      Key key;
      if (needs(actions[j], &key)) post_receive(key);
    }
    model::GPT& g = stage_model(a.stage);
    try {
      Key key;
      std::vector<float> in;
      if (needs(a, &key)) in = take(key);
      Interval iv{a, clock.seconds(), 0};
      if (a.op == Op::F) {
        std::vector<int>& pool = free_slots[a.stage];
        int slot;
        if (pool.empty()) {
          slot = slots_made[a.stage]++;
        } else {
          slot = pool.back();
          pool.pop_back();
        }
        slot_of[a.stage][a.micro] = slot;
        const bool last = a.stage == S - 1;
        const MicroBatch& mb = batches[a.micro];
        if (!training && g.whole_model()) {  // one stage: nothing to keep for a backward or a next stage
          loss_sum += g.evaluate(mb.inputs, mb.targets, B, T);
          free_slots[a.stage].push_back(slot);
          iv.end = clock.seconds();
          timeline_.push_back(iv);
          continue;
        }
        const float loss =
            g.forward_stage(slot, a.stage == 0 ? mb.inputs : nullptr, a.stage == 0 ? nullptr : in.data(),
                            last ? mb.targets : nullptr, B, T, loss_scale_ / static_cast<float>(m));
        if (last) loss_sum += loss;
        if (!last) deliver({a.stage, a.micro, false}, g.stage_output(slot), a.stage + 1);
        if (!training) {
          g.release(slot);
          free_slots[a.stage].push_back(slot);
        }
      } else {
        const int slot = slot_of[a.stage][a.micro];
        if (a.op != Op::W && a.stage < S - 1) g.set_stage_output_grad(slot, in.data());
        if (a.op != Op::I && backward_begins_) backward_begins_(a.stage, last_backward[a.stage] == i);
        if (a.op == Op::B) g.backward(slot);
        if (a.op == Op::I) g.backward_input(slot);
        if (a.op == Op::W) g.backward_weight(slot);
        if (a.op != Op::W && a.stage > 0) deliver({a.stage, a.micro, true}, g.stage_input_grad(slot), a.stage - 1);
        if (a.op != Op::I) free_slots[a.stage].push_back(slot);  // its last backward: the slot is free
      }
      iv.end = clock.seconds();
      timeline_.push_back(iv);
      if (training && stage_done_ && last_backward[a.stage] == i) stage_done_(a.stage);
    } catch (const Error& e) {
      // Under a pipeline the message says which action failed; one stage
      // (the whole model) needs no such pointer.
      if (schedule_.ranks == 1) throw;
      LATTICE_FAIL("pipeline rank " << me << " action " << i + 1 << " '" << to_string(a) << "': " << e.what());
    }
  }
  for (Pending& p : sends) p.work->wait();
  return loss_sum;
}

void Executor::sum_tied(float* first, float* last, size_t n) {
  if (schedule_.stages == 1 || (!first && !last)) return;
  if (first && last) {  // both on this rank
    for (size_t i = 0; i < n; i++) first[i] += last[i];
    std::memcpy(last, first, sizeof(float) * n);
    return;
  }
  embedding_group_->all_reduce(first ? first : last, n, DType::F32, comm::ReduceOp::Sum);
}

std::vector<std::vector<Interval>> Executor::gather_timelines() {
  const int n = group_.size();
  std::vector<double> mine;
  for (const Interval& iv : timeline_)
    mine.insert(mine.end(), {static_cast<double>(iv.action.stage), static_cast<double>(iv.action.op),
                             static_cast<double>(iv.action.micro), iv.start, iv.end});
  std::vector<double> counts_d(static_cast<size_t>(n));
  double c = static_cast<double>(mine.size());
  group_.all_gather(&c, counts_d.data(), 1, DType::F64);
  std::vector<size_t> counts(static_cast<size_t>(n));
  size_t total = 0;
  for (int r = 0; r < n; r++) total += counts[r] = static_cast<size_t>(counts_d[r]);
  std::vector<double> all(total);
  group_.all_gather_v(mine.data(), all.data(), counts, DType::F64);
  std::vector<std::vector<Interval>> out(static_cast<size_t>(n));
  size_t at = 0;
  for (int r = 0; r < n; r++)
    for (size_t k = 0; k < counts[r]; k += 5, at += 5)
      out[r].push_back(
          {{static_cast<int>(all[at]), static_cast<Op>(static_cast<int>(all[at + 1])), static_cast<int>(all[at + 2])},
           all[at + 3],
           all[at + 4]});
  return out;
}

}  // namespace lattice::pipeline
