// A data-parallel training job that fails on purpose, for dp_cli_test:
//
//   mpiexec -n 2 dp_fault_program throw-mid-backward | throw-mid-backward-tp
//
// trains a tiny model at dp=2; on step 2, rank 1 throws from inside its
// backward (when the backward reaches block 0, after it has posted the
// reduction of block 1), while rank 0 runs on into that step's reductions
// and waits there for a partner that never comes. The job must end with
// rank 1's message within seconds (run_guarded aborts it), not hang.
// throw-mid-backward-tp: the same at tp=2 with sequence parallelism, where
// rank 0 waits inside the backward itself, in a TP collective of block 0.
// throw-mid-pipeline: pp=2 with 1F1B, rank 1 (the last stage) throws in a
// backward of step 2 while rank 0 waits for the gradient it would send.
#include <cstdio>
#include <cstring>
#include <string>

#include "lattice/comm/runtime.h"
#include "lattice/core/error.h"
#include "lattice/io/config.h"
#include "lattice/train/trainer.h"

using namespace lattice;

namespace {

// Forwards to the trainer's hooks (the data-parallel engine's), and throws once on one rank.
class ThrowingHooks final : public model::GroupHooks {
 public:
  ThrowingHooks(model::GroupHooks* inner, const train::Trainer& trainer) : inner_(inner), trainer_(trainer) {}
  void before_params(size_t g, Pass pass) override {
    if (comm::world_rank() == 1 && trainer_.step() == 1 && pass == Pass::Backward && g == 1)
      LATTICE_FAIL("injected failure in the backward of block 0 at step 2");
    if (inner_) inner_->before_params(g, pass);
  }
  void after_params(size_t g, Pass pass) override {
    if (inner_) inner_->after_params(g, pass);
  }
  void before_grads(size_t g) override {
    if (inner_) inner_->before_grads(g);
  }
  void grads_done(size_t g) override {
    if (inner_) inner_->grads_done(g);
  }

 private:
  model::GroupHooks* inner_;
  const train::Trainer& trainer_;
};

}  // namespace

int main(int argc, char** argv) {
  return comm::run_guarded(argc, argv, [&] {
    const bool tp = argc == 2 && std::strcmp(argv[1], "throw-mid-backward-tp") == 0;
    const bool pp = argc == 2 && std::strcmp(argv[1], "throw-mid-pipeline") == 0;
    LATTICE_CHECK(argc == 2 && (tp || pp || std::strcmp(argv[1], "throw-mid-backward") == 0),
                  "usage: dp_fault_program throw-mid-backward | throw-mid-backward-tp | throw-mid-pipeline");
    io::RunConfig c;
    c.model.n_layer = 2;
    c.model.n_head = 2;
    c.model.n_embd = 32;
    c.model.vocab_size = 64;
    c.model.seq_len = 16;
    c.train.micro_batch_size = 2;
    c.train.threads = 1;
    c.train.steps = 5;
    c.parallel.dp = tp || pp ? 1 : comm::world_size();
    c.parallel.tp = tp ? comm::world_size() : 1;
    c.parallel.sequence_parallel = tp;
    c.parallel.pp = pp ? comm::world_size() : 1;
    if (pp) c.train.grad_accum_steps = 4;
    c.parallel.bucket_mb = 0.01;
    train::Trainer t(c, train::TrainerOptions{false});
    ThrowingHooks hooks(t.model().hooks(), t);
    t.model().set_hooks(&hooks);
    for (int s = 0; s < 5; s++) t.train_step();
    std::printf("rank %d: finished without the injected failure\n", comm::world_rank());
    return 0;
  });
}
