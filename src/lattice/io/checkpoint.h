// Checkpoint directories: layout, atomic commit, integrity, retention.
//
//   <dir>/step_000120/model.safetensors      (files are the trainer's choice)
//   <dir>/step_000120/optimizer.safetensors
//   <dir>/step_000120/meta.json              {"format": "lattice-checkpoint-1", "step": 120,
//                                              ..., "files": {"model.safetensors":
//                                              {"bytes": 1234, "crc32c": "89abcdef"}, ...}}
//   <dir>/latest                             "step_000120\n"
//
// A checkpoint is written into <dir>/.tmp_step_000120_<pid>/, every file is
// fsynced, meta.json (with a CRC32C and size of every other file) is written
// last inside it, the directory is fsynced and renamed to step_000120, <dir>
// is fsynced, and only then is <dir>/latest replaced (tmp file + rename). A
// crash at any point leaves either the previous checkpoint as `latest` or the
// new one complete: a .tmp_* directory is never taken for a checkpoint, and a
// step_* directory exists only after all of its contents are durable.
//
// The trainer fills in the contents:
//
//   CheckpointWriter w(cfg.checkpoint.dir, step);
//   model_writer.write(w.path("model.safetensors"));
//   JsonValue meta = JsonValue::object();
//   meta.set("config", JsonValue::string(config_to_toml(cfg)));
//   std::string step_dir = w.commit(std::move(meta), cfg.checkpoint.keep);
//
//   std::string dir = resolve_checkpoint("latest", cfg.checkpoint.dir);
//   verify_checkpoint(dir);                       // checksums of every file
//   JsonValue meta = read_checkpoint_meta(dir);
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "lattice/io/json.h"

namespace lattice::io {

// CRC32C (Castagnoli), the checksum of iSCSI/ext4/LevelDB. Pass the previous
// result as `crc` to continue over more data (crc32c(ab) == crc32c(b, crc32c(a))).
// Uses the SSE4.2 instruction when the CPU has it.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);
// CRC32C of a whole file, streamed; also returns its size in *bytes if given.
uint32_t crc32c_file(const std::string& path, uint64_t* bytes = nullptr);

// "step_000120" (at least 6 digits; more when the step needs them).
std::string step_dir_name(int64_t step);
// The step of a "step_000120" name; nullopt for any other name.
std::optional<int64_t> parse_step_dir_name(const std::string& name);

class CheckpointWriter {
 public:
  // Creates `dir` if needed and a fresh <dir>/.tmp_step_NNNNNN_<pid>/.
  CheckpointWriter(const std::string& dir, int64_t step);
  // Removes the temporary directory if commit() did not happen (error paths).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Where to write a file of this checkpoint: <tmp dir>/<file_name>. Write the
  // file completely before commit(); any writer will do (SafeTensorsWriter,
  // write_file below). Names are plain file names (no '/'), not "meta.json".
  std::string path(const std::string& file_name) const;
  // Writes a small file of the checkpoint (e.g. a text dump).
  void write_file(const std::string& file_name, const std::string& contents);
  const std::string& tmp_dir() const { return tmp_dir_; }

  // Seals the checkpoint: fsyncs every file, writes meta.json = `meta` (an
  // object; the trainer's fields) plus "format", "step" and "files" (name ->
  // {"bytes", "crc32c"}), renames the directory to <dir>/step_NNNNNN (replacing
  // an older directory of the same step), updates <dir>/latest, and then
  // deletes older step_* directories so that `keep` remain (0 = keep all).
  // Returns the final directory path.
  std::string commit(JsonValue meta, int keep);

 private:
  std::string dir_;
  int64_t step_;
  std::string tmp_dir_;
  bool committed_ = false;
};

// Deletes every step_* directory of `dir` except the newest `keep` (by step;
// 0 = keep all) and the one <dir>/latest names. Returns the deleted paths.
std::vector<std::string> prune_checkpoints(const std::string& dir, int keep);

// Complete checkpoints of `dir` (step_* directories holding meta.json), oldest first.
std::vector<std::string> list_checkpoints(const std::string& dir);

// The newest checkpoint of `dir`: the one <dir>/latest names, or, when there
// is no latest file, the highest complete step_* directory; nullopt when the
// directory holds none (a fresh run). Errors if `latest` names a missing directory.
std::optional<std::string> find_latest_checkpoint(const std::string& dir);

// Maps a resume spec to a step directory:
//   "latest"        -> find_latest_checkpoint(checkpoint_dir), error if none
//   a step dir      -> itself (it must hold meta.json)
//   a checkpoint dir (holding `latest` or step_* dirs) -> its newest checkpoint
// Errors name the path: "no checkpoint found in 'runs/x'", "'runs/x/latest'
// names 'step_000010' which does not exist".
std::string resolve_checkpoint(const std::string& spec, const std::string& checkpoint_dir = "");

// Checks every file listed in meta.json against its size and CRC32C. Errors:
// "checkpoint file 'runs/x/step_000010/model.safetensors' is truncated (... bytes, expected ...)",
// "... is corrupted: checksum mismatch", "... is missing".
void verify_checkpoint(const std::string& step_dir);

// meta.json of a step directory, parsed.
JsonValue read_checkpoint_meta(const std::string& step_dir);

}  // namespace lattice::io
