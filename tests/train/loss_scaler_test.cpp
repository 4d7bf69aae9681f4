// The loss scaler's state machine (train/loss_scaler.h): backoff on an
// overflow, growth after a window of clean steps, the floor, a static scale,
// and the checkpointed state.
#include "lattice/optim/loss_scaler.h"

#include <gtest/gtest.h>

#include "lattice/core/error.h"

using namespace lattice;
using lattice::optim::LossScaler;
using lattice::optim::LossScalerConfig;

TEST(LossScaler, BacksOffOnOverflowAndGrowsAfterTheWindow) {
  LossScalerConfig c;
  c.scale = 1024;
  c.window = 3;
  LossScaler s(c);
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_FALSE(s.update(false));  // overflow: skipped, halved
  EXPECT_TRUE(s.last_skipped());
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.skipped(), 1);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_FALSE(s.last_skipped());
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.clean_steps(), 2);
  EXPECT_TRUE(s.update(true));  // the third clean step in a row: doubled
  EXPECT_EQ(s.scale(), 1024);
  EXPECT_EQ(s.clean_steps(), 0);
  EXPECT_TRUE(s.update(true));
  EXPECT_TRUE(s.update(true));
  EXPECT_FALSE(s.update(false));  // an overflow restarts the count
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.clean_steps(), 0);
  EXPECT_EQ(s.skipped(), 2);
}

TEST(LossScaler, NeverBacksOffBelowTheFloor) {
  LossScalerConfig c;
  c.scale = 8;
  c.min_scale = 2;
  c.backoff = 0.25;
  LossScaler s(c);
  s.update(false);
  EXPECT_EQ(s.scale(), 2);
  s.update(false);
  EXPECT_EQ(s.scale(), 2);
  EXPECT_EQ(s.skipped(), 2);
}

TEST(LossScaler, StaticScaleSkipsOverflowsAndNeverMoves) {
  LossScalerConfig c;
  c.dynamic = false;
  c.scale = 128;
  LossScaler s(c);
  for (int i = 0; i < 5; i++) EXPECT_TRUE(s.update(true));
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.skipped_in_a_row(), 2);
  EXPECT_EQ(s.scale(), 128);
  EXPECT_EQ(s.skipped(), 2);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.skipped_in_a_row(), 0);
  EXPECT_EQ(s.describe(), "static loss scale 128");
  const LossScaler none;  // f32 and bf16: scale 1
  EXPECT_EQ(none.scale(), 1);
}

TEST(LossScaler, RestoresItsStateAndRefusesNonsense) {
  LossScalerConfig c;
  c.window = 2;
  LossScaler s(c);
  s.restore(4096, 1, 7);
  EXPECT_EQ(s.scale(), 4096);
  EXPECT_EQ(s.skipped(), 7);
  s.update(true);  // the second clean step since the checkpoint's count
  EXPECT_EQ(s.scale(), 8192);
  EXPECT_THROW(s.restore(-1, 0, 0), Error);
  EXPECT_THROW(s.restore(1, -1, 0), Error);
  LossScalerConfig bad = c;
  bad.backoff = 1.5;
  EXPECT_THROW(LossScaler{bad}, Error);
  bad = c;
  bad.min_scale = 1e9;
  EXPECT_THROW(LossScaler{bad}, Error);
  EXPECT_EQ(LossScaler(c).describe(), "dynamic loss scale 65536 (x0.5 on overflow, x2 after 2 clean steps, floor 1)");
}
