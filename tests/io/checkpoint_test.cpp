#include "lattice/io/checkpoint.h"

#include <algorithm>
#include <filesystem>

#include <gtest/gtest.h>

#include "lattice/io/safetensors.h"
#include "test_util.h"

namespace lattice::io {
namespace {

namespace fs = std::filesystem;
using testing::read_text;
using testing::TempDir;
using testing::write_text;

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A checkpoint as the trainer writes one: a safetensors file, a text file, meta.
std::string write_checkpoint(const std::string& dir, int64_t step, int keep, float value = 1.0f) {
  CheckpointWriter w(dir, step);
  std::vector<float> weights(256, value);
  SafeTensorsWriter model;
  model.add("wte.weight", DType::F32, {16, 16}, weights.data());
  model.write(w.path("model.safetensors"));
  w.write_file("notes.txt", "step " + std::to_string(step) + "\n");
  JsonValue meta = JsonValue::object();
  meta.set("config", JsonValue::string("[train]\nsteps = 10\n"));
  meta.set("tokens_seen", JsonValue::integer(step * 1024));
  meta.set("loss_scale", JsonValue::number(65536));
  return w.commit(std::move(meta), keep);
}

TEST(Crc32c, KnownVectorsAndChaining) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  std::string text = "The quick brown fox jumps over the lazy dog, twice over and then some more.";
  for (size_t split = 0; split <= text.size(); ++split)
    EXPECT_EQ(crc32c(text.data() + split, text.size() - split, crc32c(text.data(), split)),
              crc32c(text.data(), text.size()));
}

TEST(Checkpoint, StepDirNames) {
  EXPECT_EQ(step_dir_name(0), "step_000000");
  EXPECT_EQ(step_dir_name(123), "step_000123");
  EXPECT_EQ(step_dir_name(12345678), "step_12345678");
  EXPECT_EQ(parse_step_dir_name("step_000123"), 123);
  EXPECT_EQ(parse_step_dir_name("step_12345678"), 12345678);
  EXPECT_FALSE(parse_step_dir_name("step_"));
  EXPECT_FALSE(parse_step_dir_name("step_12a"));
  EXPECT_FALSE(parse_step_dir_name(".tmp_step_000123_77"));
  EXPECT_FALSE(parse_step_dir_name("latest"));
}

TEST(Checkpoint, WriteResolveAndVerify) {
  TempDir run;
  std::string ckdir = run / "ck";  // created on demand
  std::string step_dir = write_checkpoint(ckdir, 10, 3);
  EXPECT_EQ(step_dir, ckdir + "/step_000010");
  EXPECT_EQ(names_in(ckdir), (std::vector<std::string>{"latest", "step_000010"}));
  EXPECT_EQ(names_in(step_dir), (std::vector<std::string>{"meta.json", "model.safetensors", "notes.txt"}));
  EXPECT_EQ(read_text(ckdir + "/latest"), "step_000010\n");

  JsonValue meta = read_checkpoint_meta(step_dir);
  EXPECT_EQ(meta.at("format").as_string(), "lattice-checkpoint-1");
  EXPECT_EQ(meta.at("step").as_double(), 10);
  EXPECT_EQ(meta.at("config").as_string(), "[train]\nsteps = 10\n");
  int64_t tokens = 0;
  EXPECT_TRUE(meta.at("tokens_seen").get_i64(&tokens));
  EXPECT_EQ(tokens, 10240);
  const JsonValue& files = meta.at("files");
  ASSERT_EQ(files.size(), 2u);
  uint64_t bytes = 0;
  EXPECT_TRUE(files.at("notes.txt").at("bytes").get_u64(&bytes));
  EXPECT_EQ(bytes, 8u);  // "step 10\n"
  EXPECT_EQ(files.at("notes.txt").at("crc32c").as_string().size(), 8u);
  EXPECT_NO_THROW(verify_checkpoint(step_dir));

  write_checkpoint(ckdir, 20, 3);
  EXPECT_EQ(resolve_checkpoint("latest", ckdir), ckdir + "/step_000020");
  EXPECT_EQ(resolve_checkpoint(ckdir), ckdir + "/step_000020");
  EXPECT_EQ(resolve_checkpoint(ckdir + "/step_000010"), ckdir + "/step_000010");
  EXPECT_EQ(*find_latest_checkpoint(ckdir), ckdir + "/step_000020");
  EXPECT_EQ(list_checkpoints(ckdir), (std::vector<std::string>{ckdir + "/step_000010", ckdir + "/step_000020"}));

  // The files load back.
  SafeTensorsReader reader(resolve_checkpoint("latest", ckdir) + "/model.safetensors");
  std::vector<float> w(256);
  reader.read_f32("wte.weight", w.data(), std::vector<int64_t>{16, 16});
  EXPECT_EQ(w[7], 1.0f);
}

TEST(Checkpoint, KeepLastN) {
  TempDir run;
  for (int64_t step : {5, 10, 15, 20, 25}) write_checkpoint(run.path(), step, 2);
  EXPECT_EQ(names_in(run.path()), (std::vector<std::string>{"latest", "step_000020", "step_000025"}));
  write_checkpoint(run.path(), 30, 0);  // keep = 0 keeps everything
  EXPECT_EQ(names_in(run.path()), (std::vector<std::string>{"latest", "step_000020", "step_000025", "step_000030"}));
  // The checkpoint `latest` names survives pruning even when it is the oldest.
  write_text(run / "latest", "step_000020\n");
  EXPECT_EQ(prune_checkpoints(run.path(), 1),
            (std::vector<std::string>{run / "step_000025"}));
  EXPECT_EQ(names_in(run.path()), (std::vector<std::string>{"latest", "step_000020", "step_000030"}));
}

TEST(Checkpoint, RewritingAStepReplacesIt) {
  TempDir run;
  write_checkpoint(run.path(), 10, 3, 1.0f);
  write_checkpoint(run.path(), 10, 3, 2.0f);
  EXPECT_EQ(names_in(run.path()), (std::vector<std::string>{"latest", "step_000010"}));
  std::vector<float> w(256);
  SafeTensorsReader(run / "step_000010/model.safetensors").read_f32("wte.weight", w.data(), 256);
  EXPECT_EQ(w[0], 2.0f);
  EXPECT_NO_THROW(verify_checkpoint(run / "step_000010"));
}

TEST(Checkpoint, CorruptionIsDetected) {
  TempDir run;
  std::string dir = write_checkpoint(run.path(), 7, 3);
  std::string model = dir + "/model.safetensors";
  std::string original = read_text(model);

  std::string flipped = original;
  flipped[flipped.size() / 2] ^= 0x01;
  write_text(model, flipped);
  EXPECT_ERROR_CONTAINS(verify_checkpoint(dir), "checkpoint file '" + model + "' is corrupted: checksum mismatch");

  write_text(model, original.substr(0, original.size() - 10));
  EXPECT_ERROR_CONTAINS(verify_checkpoint(dir), "checkpoint file '" + model + "' is truncated (" +
                                                    std::to_string(original.size() - 10) + " bytes, expected " +
                                                    std::to_string(original.size()) + ")");
  write_text(model, original + "x");
  EXPECT_ERROR_CONTAINS(verify_checkpoint(dir), "checkpoint file '" + model + "' has the wrong size");

  write_text(model, original);
  EXPECT_NO_THROW(verify_checkpoint(dir));
  fs::remove(dir + "/notes.txt");
  EXPECT_ERROR_CONTAINS(verify_checkpoint(dir), "checkpoint file '" + dir + "/notes.txt' is missing");

  write_text(dir + "/meta.json", "{\"format\": \"lattice-checkpoint-1\", \"files\": ");
  EXPECT_ERROR_CONTAINS(verify_checkpoint(dir), "checkpoint meta '" + dir + "/meta.json': invalid JSON");
  write_text(dir + "/meta.json", "{\"files\": {}}");
  EXPECT_ERROR_CONTAINS(verify_checkpoint(dir), "has an unknown format");
  write_text(dir + "/meta.json", "{\"format\": \"lattice-checkpoint-1\", \"files\": {\"../x\": {}}}");
  EXPECT_ERROR_CONTAINS(verify_checkpoint(dir), "lists an invalid file name '../x'");
  fs::remove(dir + "/meta.json");
  EXPECT_ERROR_CONTAINS(verify_checkpoint(dir), "'" + dir + "' is not a checkpoint: '" + dir + "/meta.json' is missing");
}

TEST(Checkpoint, AbandonedWriteLeavesNoCheckpoint) {
  TempDir run;
  write_checkpoint(run.path(), 10, 3);
  std::string tmp;
  {
    CheckpointWriter w(run.path(), 20);
    tmp = w.tmp_dir();
    EXPECT_NE(tmp.find("/.tmp_step_000020_"), std::string::npos);
    w.write_file("model.safetensors", "partial");
    EXPECT_TRUE(fs::exists(tmp));
    // The half-written checkpoint is invisible while it is being written...
    EXPECT_EQ(resolve_checkpoint("latest", run.path()), run / "step_000010");
    EXPECT_EQ(list_checkpoints(run.path()).size(), 1u);
  }  // ...and removed when the writer is dropped without commit (an exception unwinding).
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_EQ(names_in(run.path()), (std::vector<std::string>{"latest", "step_000010"}));

  // A tmp dir left by a crashed process is never taken for a checkpoint.
  fs::create_directories(run / ".tmp_step_000030_999999");
  write_text(run / ".tmp_step_000030_999999/meta.json", "{}");
  fs::remove(run / "latest");
  EXPECT_EQ(resolve_checkpoint(run.path()), run / "step_000010");
}

TEST(Checkpoint, ResolveErrors) {
  TempDir run;
  EXPECT_ERROR_CONTAINS(resolve_checkpoint("latest", run.path()), "no checkpoint found in '" + run.path() + "'");
  EXPECT_FALSE(find_latest_checkpoint(run.path()).has_value());
  EXPECT_FALSE(find_latest_checkpoint(run / "does-not-exist").has_value());
  EXPECT_ERROR_CONTAINS(resolve_checkpoint(run.path()), "no checkpoint found in '" + run.path() + "'");
  EXPECT_ERROR_CONTAINS(resolve_checkpoint("latest", ""), "checkpoint.resume = \"latest\" needs checkpoint.dir");
  EXPECT_ERROR_CONTAINS(resolve_checkpoint(run / "nope"), "checkpoint '" + (run / "nope") + "' does not exist");
  write_text(run / "file", "x");
  EXPECT_ERROR_CONTAINS(resolve_checkpoint(run / "file"), "is a file; give a checkpoint directory");

  write_checkpoint(run.path(), 10, 3);
  write_text(run / "latest", "step_000099\n");
  EXPECT_ERROR_CONTAINS(resolve_checkpoint("latest", run.path()),
                        "'" + (run / "latest") + "' names 'step_000099' which does not exist");
  write_text(run / "latest", "../../etc\n");
  EXPECT_ERROR_CONTAINS(resolve_checkpoint("latest", run.path()), "should hold a checkpoint directory name");

  // No `latest` file (a crash between the rename and its update): the newest complete step wins.
  fs::remove(run / "latest");
  write_checkpoint(run.path(), 30, 0);
  fs::remove(run / "latest");
  fs::create_directories(run / "step_000040");  // incomplete: no meta.json
  EXPECT_EQ(resolve_checkpoint("latest", run.path()), run / "step_000030");
}

TEST(Checkpoint, WriterRejectsBadNames) {
  TempDir run;
  CheckpointWriter w(run.path(), 1);
  EXPECT_ERROR_CONTAINS(w.path("a/b"), "checkpoint file name must be a plain name, got 'a/b'");
  EXPECT_ERROR_CONTAINS(w.path("meta.json"), "'meta.json' is written by CheckpointWriter::commit");
  EXPECT_ERROR_CONTAINS(w.commit(JsonValue::array(), 3), "checkpoint meta must be a JSON object");
  EXPECT_ERROR_CONTAINS(CheckpointWriter("", 1), "checkpoint directory is empty (set checkpoint.dir)");
}

}  // namespace
}  // namespace lattice::io
