// What the trainer keeps under pipeline parallelism (pipeline_training.cpp);
// a header of its own so the trainer's other files see a complete type.
#pragma once

#include <memory>
#include <vector>

#include "lattice/model/gpt.h"
#include "lattice/optim/adamw.h"
#include "lattice/parallel/pipeline/executor.h"
#include "lattice/parallel/pipeline/partition.h"
#include "lattice/parallel/pipeline/schedule.h"
#include "lattice/parallel/zero/distributed_optimizer.h"
#include "lattice/train/trainer.h"

namespace lattice::train {

struct Trainer::Pipeline {
  pipeline::Schedule schedule;
  std::vector<pipeline::ChunkLayers> cut;            // layers of each stage
  std::vector<std::unique_ptr<model::GPT>> models;   // this rank's stages, in stage order
  std::vector<int> model_stage;                      // their stage indices
  // AdamW over every model, with data parallelism (ZeRO 0-3) over the replicas.
  std::unique_ptr<parallel::DistributedOptimizer> optimizer;
  std::unique_ptr<model::GPT> whole;                 // the whole model, declared only (checkpoint layout)
  std::unique_ptr<pipeline::Executor> executor;
  std::vector<std::vector<int32_t>> inputs, targets;  // per micro-batch
  double last_bubble = -1, last_simulated = -1;
};

}  // namespace lattice::train
