// libFuzzer harness: the IDX reader (worker/trainer/idx_reader.h) that loads
// Fashion-MNIST, plain or gzipped (a data directory is user input, and a
// truncated download is common).
//
// Input: byte 0: bit 0: labels (set) or images; bit 1: gzip the rest before
// writing it (the reader sees a .gz stream; zlib's gzread reads both); the
// rest is the file. Invariants:
//   - failure is DATA_LOSS (wrong magic, truncated, trailing bytes, corrupt
//     gzip) or INVALID_ARGUMENT (not 28x28, a label > 9), with a message;
//     never an abort, a read out of bounds, or an allocation the header
//     asks for before the payload is known to be there;
//   - images: rows == cols == 28 and pixels.size() == count * 28 * 28, and
//     the pixels are the file's bytes after the 16-byte header (plain
//     input); labels: every label <= 9, labels.size() is the header's
//     count, and they are the bytes after the 8-byte header.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_files.h"
#include "worker/trainer/idx_reader.h"

namespace {

void WriteGzip(const std::string& path, absl::string_view bytes) {
  gzFile f = gzopen(path.c_str(), "wb1");
  FUZZ_CHECK(f != nullptr, "gzopen %s", path.c_str());
  if (!bytes.empty()) {
    FUZZ_CHECK(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) ==
                   static_cast<int>(bytes.size()),
               "gzwrite");
  }
  FUZZ_CHECK(gzclose(f) == Z_OK, "gzclose");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gtopk;
  using namespace gtopk::worker;
  fuzz::Bytes in(data, size);
  const uint8_t control = in.U8();
  const bool labels = (control & 1) != 0;
  const bool gzip = (control & 2) != 0;
  const absl::string_view file = in.Rest();
  const std::string path = fuzz::ScratchDir() + "/input.idx";
  // A plain file that starts like gzip is read as gzip: its bytes are then
  // not the content.
  const bool content_is_input =
      gzip || !(file.size() >= 2 && file[0] == '\x1f' && file[1] == '\x8b');
  if (gzip) {
    WriteGzip(path, file);
  } else {
    fuzz::WriteFile(path, file);
  }

  if (labels) {
    absl::StatusOr<IdxLabels> l = ReadIdxLabels(path);
    if (!l.ok()) {
      FUZZ_CHECK(
          absl::IsDataLoss(l.status()) || absl::IsInvalidArgument(l.status()),
          "ReadIdxLabels: %s", l.status().ToString().c_str());
      FUZZ_CHECK(!l.status().message().empty(), "error without a message");
      return 0;
    }
    for (uint8_t v : l->labels) FUZZ_CHECK(v <= 9, "label %u accepted", v);
    if (!content_is_input) return 0;
    FUZZ_CHECK(file.size() == 8 + l->labels.size(), "%zu labels from %zu bytes",
               l->labels.size(), file.size());
    // (memcmp with an empty vector's null data() is UB: compare as strings.)
    FUZZ_CHECK(
        file.substr(8) ==
            absl::string_view(reinterpret_cast<const char*>(l->labels.data()),
                              l->labels.size()),
        "labels are not the file's bytes");
    return 0;
  }
  absl::StatusOr<IdxImages> im = ReadIdxImages(path);
  if (!im.ok()) {
    FUZZ_CHECK(
        absl::IsDataLoss(im.status()) || absl::IsInvalidArgument(im.status()),
        "ReadIdxImages: %s", im.status().ToString().c_str());
    FUZZ_CHECK(!im.status().message().empty(), "error without a message");
    return 0;
  }
  FUZZ_CHECK(im->rows == 28 && im->cols == 28, "%ux%u accepted", im->rows,
             im->cols);
  FUZZ_CHECK(im->pixels.size() == uint64_t{im->count} * 28 * 28,
             "%zu pixels for %u images", im->pixels.size(), im->count);
  if (!content_is_input) return 0;
  FUZZ_CHECK(file.size() == 16 + im->pixels.size(), "%zu pixels from %zu bytes",
             im->pixels.size(), file.size());
  FUZZ_CHECK(file.substr(16) == absl::string_view(reinterpret_cast<const char*>(
                                                      im->pixels.data()),
                                                  im->pixels.size()),
             "pixels are not the file's bytes");
  return 0;
}
