// Tests of the IDX reader (worker/trainer/idx_reader.h): round trips of small
// gzipped and plain files written here, and every malformed-file path
// (wrong magic, truncation at several lengths, count mismatch, bad label,
// missing file) ending in a clear status, never a crash.
#include "worker/trainer/idx_reader.h"

#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace gtopk {
namespace worker {
namespace {

using ::gtopk::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

void PutBE32(std::vector<uint8_t>* out, uint32_t v) {
  out->push_back(static_cast<uint8_t>(v >> 24));
  out->push_back(static_cast<uint8_t>(v >> 16));
  out->push_back(static_cast<uint8_t>(v >> 8));
  out->push_back(static_cast<uint8_t>(v));
}

std::vector<uint8_t> ImagesFile(uint32_t count, uint32_t rows = 28,
                                uint32_t cols = 28, uint32_t magic = 0x803) {
  std::vector<uint8_t> f;
  PutBE32(&f, magic);
  PutBE32(&f, count);
  PutBE32(&f, rows);
  PutBE32(&f, cols);
  for (uint32_t i = 0; i < count * rows * cols; ++i) {
    f.push_back(static_cast<uint8_t>(i * 7 + 3));
  }
  return f;
}

std::vector<uint8_t> LabelsFile(uint32_t count, uint32_t magic = 0x801) {
  std::vector<uint8_t> f;
  PutBE32(&f, magic);
  PutBE32(&f, count);
  for (uint32_t i = 0; i < count; ++i)
    f.push_back(static_cast<uint8_t>(i % 10));
  return f;
}

class IdxReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/idx_reader_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const std::string& p : files_) std::remove(p.c_str());
    rmdir(dir_.c_str());
  }

  std::string WriteGz(const std::string& name, const std::vector<uint8_t>& b) {
    const std::string path = absl::StrCat(dir_, "/", name);
    gzFile f = gzopen(path.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    if (!b.empty()) {
      EXPECT_EQ(gzwrite(f, b.data(), static_cast<unsigned>(b.size())),
                static_cast<int>(b.size()));
    }
    EXPECT_EQ(gzclose(f), Z_OK);
    files_.push_back(path);
    return path;
  }
  std::string WritePlain(const std::string& name,
                         const std::vector<uint8_t>& b) {
    const std::string path = absl::StrCat(dir_, "/", name);
    FILE* f = std::fopen(path.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    if (!b.empty()) {
      EXPECT_EQ(std::fwrite(b.data(), 1, b.size(), f), b.size());
    }
    std::fclose(f);
    files_.push_back(path);
    return path;
  }
  std::vector<uint8_t> ReadRaw(const std::string& path) {
    std::vector<uint8_t> out;
    FILE* f = std::fopen(path.c_str(), "rb");
    int c;
    while ((c = std::fgetc(f)) != EOF) out.push_back(static_cast<uint8_t>(c));
    std::fclose(f);
    return out;
  }

  std::string dir_;
  std::vector<std::string> files_;
};

TEST_F(IdxReaderTest, RoundTripGzipped) {
  const std::vector<uint8_t> img = ImagesFile(3);
  GTOPK_ASSERT_OK_AND_ASSIGN(IdxImages images,
                             ReadIdxImages(WriteGz("img.gz", img)));
  EXPECT_EQ(images.count, 3u);
  EXPECT_EQ(images.rows, 28u);
  EXPECT_EQ(images.cols, 28u);
  EXPECT_EQ(images.pixels, std::vector<uint8_t>(img.begin() + 16, img.end()));

  GTOPK_ASSERT_OK_AND_ASSIGN(IdxLabels labels,
                             ReadIdxLabels(WriteGz("lbl.gz", LabelsFile(13))));
  ASSERT_EQ(labels.labels.size(), 13u);
  EXPECT_EQ(labels.labels[12], 2);
}

TEST_F(IdxReaderTest, RoundTripPlainAndEmpty) {
  GTOPK_ASSERT_OK_AND_ASSIGN(IdxImages images,
                             ReadIdxImages(WritePlain("img", ImagesFile(2))));
  EXPECT_EQ(images.count, 2u);
  EXPECT_EQ(images.pixels.size(), 2u * 784);
  GTOPK_ASSERT_OK_AND_ASSIGN(IdxLabels labels,
                             ReadIdxLabels(WritePlain("lbl", LabelsFile(0))));
  EXPECT_TRUE(labels.labels.empty());
}

TEST_F(IdxReaderTest, DatasetPairsImagesAndLabels) {
  GTOPK_ASSERT_OK_AND_ASSIGN(IdxDataset d,
                             ReadIdxDataset(WriteGz("i.gz", ImagesFile(4)),
                                            WriteGz("l.gz", LabelsFile(4))));
  EXPECT_EQ(d.images.count, 4u);
  EXPECT_EQ(d.labels.labels.size(), 4u);
}

TEST_F(IdxReaderTest, WrongMagic) {
  EXPECT_THAT(ReadIdxImages(WriteGz("i.gz", ImagesFile(1, 28, 28, 0x801))),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("wrong IDX magic 0x00000801"),
                             HasSubstr("i.gz"))));
  // A label file given as images and vice versa.
  EXPECT_THAT(ReadIdxLabels(WriteGz("l.gz", ImagesFile(1))),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("wrong IDX magic 0x00000803")));
  // Not IDX at all (e.g. an HTML error page saved as the file).
  const std::string html = "<html>not found</html>";
  EXPECT_THAT(ReadIdxImages(WritePlain(
                  "h", std::vector<uint8_t>(html.begin(), html.end()))),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("magic")));
}

TEST_F(IdxReaderTest, TruncatedAtSeveralLengths) {
  const std::vector<uint8_t> img = ImagesFile(3);
  for (size_t len : {size_t{0}, size_t{3}, size_t{8}, size_t{15}, size_t{16},
                     size_t{17}, size_t{16 + 784}, img.size() - 1}) {
    SCOPED_TRACE(absl::StrCat("length ", len));
    const std::vector<uint8_t> cut(img.begin(), img.begin() + len);
    EXPECT_THAT(ReadIdxImages(WriteGz(absl::StrCat("i", len, ".gz"), cut)),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
    EXPECT_THAT(ReadIdxImages(WritePlain(absl::StrCat("p", len), cut)),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
  }
  const std::vector<uint8_t> lbl = LabelsFile(10);
  for (size_t len :
       {size_t{0}, size_t{7}, size_t{8}, size_t{9}, lbl.size() - 1}) {
    SCOPED_TRACE(absl::StrCat("label length ", len));
    const std::vector<uint8_t> cut(lbl.begin(), lbl.begin() + len);
    EXPECT_THAT(ReadIdxLabels(WriteGz(absl::StrCat("l", len, ".gz"), cut)),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
  }
}

TEST_F(IdxReaderTest, TruncatedGzipStream) {
  // A valid gzip file cut in the middle of its compressed stream.
  const std::string full = WriteGz("full.gz", ImagesFile(50));
  std::vector<uint8_t> raw = ReadRaw(full);
  ASSERT_GT(raw.size(), 40u);
  for (size_t keep : {raw.size() / 2, raw.size() - 4, size_t{12}}) {
    SCOPED_TRACE(absl::StrCat("keep ", keep));
    const std::vector<uint8_t> cut(raw.begin(), raw.begin() + keep);
    EXPECT_THAT(
        ReadIdxImages(WritePlain(absl::StrCat("cut", keep, ".gz"), cut)),
        StatusIs(absl::StatusCode::kDataLoss));
  }
}

TEST_F(IdxReaderTest, HugeHeaderCountIsRejectedWithoutAllocating) {
  // Header claims 2^32-1 images; only one is present.
  std::vector<uint8_t> img = ImagesFile(1);
  img[4] = img[5] = img[6] = img[7] = 0xff;
  EXPECT_THAT(ReadIdxImages(WriteGz("huge.gz", img)),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("header says 3367254359280 payload bytes")));
}

TEST_F(IdxReaderTest, TrailingBytes) {
  std::vector<uint8_t> lbl = LabelsFile(5);
  lbl.push_back(1);
  EXPECT_THAT(
      ReadIdxLabels(WriteGz("l.gz", lbl)),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("1 unexpected bytes")));
}

TEST_F(IdxReaderTest, WrongImageSize) {
  EXPECT_THAT(ReadIdxImages(WriteGz("i.gz", ImagesFile(1, 32, 32))),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("32x32, expected 28x28")));
}

TEST_F(IdxReaderTest, LabelOutOfRange) {
  std::vector<uint8_t> lbl = LabelsFile(5);
  lbl[8 + 3] = 10;
  EXPECT_THAT(ReadIdxLabels(WriteGz("l.gz", lbl)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("label 10 at index 3")));
}

TEST_F(IdxReaderTest, CountMismatch) {
  const std::string images = WriteGz("i.gz", ImagesFile(3));
  const std::string labels = WriteGz("l.gz", LabelsFile(4));
  EXPECT_THAT(ReadIdxDataset(images, labels),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("3 images"), HasSubstr("4 labels"),
                             HasSubstr(images), HasSubstr(labels))));
}

TEST_F(IdxReaderTest, MissingFileNamesPathAndPackage) {
  const std::string path =
      absl::StrCat(dir_, "/nope/train-images-idx3-ubyte.gz");
  EXPECT_THAT(
      ReadIdxImages(path),
      StatusIs(absl::StatusCode::kNotFound,
               AllOf(HasSubstr(path), HasSubstr("dataset-fashion-mnist"),
                     HasSubstr("--data-dir"))));
  const FashionMnistFiles f = FashionMnistPaths(dir_);
  EXPECT_THAT(ReadIdxDataset(f.train_images, f.train_labels),
              StatusIs(absl::StatusCode::kNotFound,
                       HasSubstr("train-images-idx3-ubyte.gz")));
}

TEST_F(IdxReaderTest, DirectoryIsNotAFile) {
  EXPECT_THAT(ReadIdxImages(dir_), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr("not a regular file")));
}

TEST(IdxReaderInstalledTest, FashionMnistWhenInstalled) {
  const FashionMnistFiles f = FashionMnistPaths(kDefaultFashionMnistDir);
  if (access(f.test_images.c_str(), R_OK) != 0) {
    GTEST_SKIP() << "dataset-fashion-mnist not installed";
  }
  GTOPK_ASSERT_OK_AND_ASSIGN(IdxDataset test,
                             ReadIdxDataset(f.test_images, f.test_labels));
  EXPECT_EQ(test.images.count, 10000u);
  EXPECT_EQ(test.labels.labels.size(), 10000u);
}

}  // namespace
}  // namespace worker
}  // namespace gtopk
