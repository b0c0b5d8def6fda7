// libFuzzer harness: the checkpoint reader (server/checkpoint.h
// ReadCheckpointFile), what a shard trusts at restart (a file another
// process, a bad disk or a hostile volume may have written).
//
// Input: byte 0: bit 0 set: the harness writes the right CRC-32 over the
// file before reading it (so the checks after the checksum are reached),
// bits 1..7: the shard id the reader expects (0..127); the rest is the file.
// Invariants:
//   - failure is DATA_LOSS (a bad file) with a message; never an abort, a
//     huge allocation (the header's counts are checked against the file
//     size first; ASan's -malloc_limit_mb catches a violation) or a read
//     out of bounds;
//   - success gives a consistent checkpoint (shard id as expected and <
//     num_shards, begin <= end <= n, end - begin params, velocity empty or
//     as long, next_step >= 0, every value finite), which
//     ValidateCheckpointFor accepts for its own layout, and which
//     WriteCheckpoint writes back as exactly the bytes read (the format is
//     canonical), so a restart after a restart restores the same state.
#include <zlib.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_files.h"
#include "server/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gtopk;
  using namespace gtopk::server;
  fuzz::Bytes in(data, size);
  const uint8_t control = in.U8();
  const bool fix_crc = (control & 1) != 0;
  const uint32_t shard_id = control >> 1;
  std::string file(in.Rest());
  if (fix_crc && file.size() >= kCheckpointTrailerBytes) {
    const size_t body = file.size() - kCheckpointTrailerBytes;
    const uint32_t crc = static_cast<uint32_t>(
        crc32(0, reinterpret_cast<const Bytef*>(file.data()),
              static_cast<uInt>(body)));
    for (int i = 0; i < 4; ++i)
      file[body + i] = static_cast<char>(crc >> (8 * i));
  }
  const std::string dir = fuzz::ScratchDir();
  const std::string path = dir + "/input.ckpt";
  fuzz::WriteFile(path, file);

  absl::StatusOr<ShardCheckpoint> c = ReadCheckpointFile(path, shard_id);
  if (!c.ok()) {
    FUZZ_CHECK(absl::IsDataLoss(c.status()), "ReadCheckpointFile: %s",
               c.status().ToString().c_str());
    FUZZ_CHECK(!c.status().message().empty(), "error without a message");
    return 0;
  }
  FUZZ_CHECK(c->shard_id == shard_id && c->shard_id < c->num_shards,
             "shard %u of %u accepted (expected %u)", c->shard_id,
             c->num_shards, shard_id);
  FUZZ_CHECK(c->begin <= c->end && c->end <= c->n, "range accepted");
  FUZZ_CHECK(c->params.size() == c->end - c->begin, "params count");
  FUZZ_CHECK(c->global_velocity.empty() ||
                 c->global_velocity.size() == c->params.size(),
             "velocity count");
  FUZZ_CHECK(c->next_step >= 0, "negative next_step accepted");
  for (float v : c->params) FUZZ_CHECK(std::isfinite(v), "param %a", v);
  for (float v : c->global_velocity) {
    FUZZ_CHECK(std::isfinite(v), "velocity %a", v);
  }
  FUZZ_CHECK(
      file.size() == kCheckpointHeaderBytes + kCheckpointTrailerBytes +
                         4 * (c->params.size() + c->global_velocity.size()),
      "file size");
  const absl::Status layout = ValidateCheckpointFor(
      *c, c->shard_id, c->num_shards, c->n, c->begin, c->end);
  FUZZ_CHECK(layout.ok(), "own layout refused: %s", layout.ToString().c_str());

  // Written back: the same bytes.
  const absl::Status w = WriteCheckpoint(dir, *c);
  FUZZ_CHECK(w.ok(), "WriteCheckpoint of a read checkpoint: %s",
             w.ToString().c_str());
  const std::string written = fuzz::ReadFile(CheckpointPath(dir, c->shard_id));
  FUZZ_CHECK(written == file,
             "re-written checkpoint differs from the file read");
  return 0;
}
