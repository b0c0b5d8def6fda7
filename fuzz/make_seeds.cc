// Writes the seed corpora of the fuzz harnesses (fuzz/corpus/<harness>/)
// from real encodes: sparse messages from EncodeSparse, cluster specs from
// CanonicalClusterSpec, request messages the way workers and shards fill
// them, checkpoints from WriteCheckpoint, small IDX files. Run by hand
// after a format change (docs/fuzzing.md, "Seed corpora"):
//
//   build-fuzz/fuzz/make_seeds fuzz/corpus
//
// Deterministic: the same build writes the same bytes.
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cluster_spec/cluster_spec.h"
#include "common/codec.h"
#include "gtopk/v1/gtopk.pb.h"
#include "server/checkpoint.h"
#include "server/server_config.h"

namespace {

using namespace gtopk;

std::string out_root;

void Write(const std::string& harness, const std::string& name,
           const std::string& bytes) {
  const std::string dir = out_root + "/" + harness;
  ::mkdir(out_root.c_str(), 0755);
  ::mkdir(dir.c_str(), 0755);
  const std::string path = dir + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr ||
      std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
    std::fprintf(stderr, "make_seeds: cannot write %s\n", path.c_str());
    std::exit(1);
  }
  std::fclose(f);
}

std::string U32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}
std::string U64(uint64_t v) {
  return U32(static_cast<uint32_t>(v)) + U32(v >> 32);
}
std::string F32(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return U32(b);
}
std::string U16(size_t v) {
  return std::string{static_cast<char>(v & 0xFF), static_cast<char>(v >> 8)};
}

SparseVector Example(uint32_t n) {
  SparseVector v;
  const float values[] = {1.5f, -0.0f, 3.0e-39f, -65504.0f, 0.1f, 7.0f};
  uint32_t i = 0, j = 0;
  for (uint32_t gap : {0u, 2u, 13u, 1u, 200u, 700u}) {
    i += gap;
    if (i >= n) break;
    v.push_back(i, values[j++]);
    ++i;
  }
  return v;
}

std::string Encode(const SparseVector& v, uint64_t n, CodecSpec spec) {
  std::string out;
  if (!EncodeSparse(v, n, spec, &out).ok()) std::exit(1);
  return out;
}

void Codecs() {
  const char* index_names[] = {"raw", "varint", "bitpack"};
  const char* value_names[] = {"fp32", "fp16", "bf16"};
  for (int i = 0; i < 3; ++i) {
    for (int v = 0; v < 3; ++v) {
      const CodecSpec spec{static_cast<IndexCodec>(i),
                           static_cast<ValueCodec>(v)};
      // codec_decode: n selector 4 (n = 1000), then the message.
      Write("codec_decode_fuzz",
            absl::StrCat(index_names[i], "_", value_names[v]),
            std::string(1, '\x04') + Encode(Example(1000), 1000, spec));
      // codec_roundtrip: codecs, n, then (gap, value) records.
      std::string rt{static_cast<char>(i), static_cast<char>(v)};
      rt += U64(1000);
      for (uint32_t gap : {0u, 5u, 100u}) rt += U32(gap) + F32(0.25f * gap - 3);
      Write("codec_roundtrip_fuzz",
            absl::StrCat(index_names[i], "_", value_names[v]), rt);
    }
  }
  Write("codec_decode_fuzz", "empty_n1",
        std::string(1, '\x01') + Encode(SparseVector(), 1, CodecSpec()));
}

server::ServerConfig Config(uint32_t shards, uint32_t shard) {
  server::ServerConfig c;
  c.shard_id = shard;
  c.num_shards = shards;
  c.num_workers = 4;
  for (uint32_t s = 0; s < shards; ++s) {
    c.peers.push_back(absl::StrCat("10.0.0.", s + 1, ":500", s));
  }
  c.optimizer.density_warmup = {0.25, 0.0625};
  c.optimizer.steps_per_epoch = 100;
  return c;
}

v1::ClusterSpec Spec(const server::ServerConfig& c, uint64_t n) {
  v1::ClusterSpec spec = server::CanonicalClusterSpec(c, n);
  for (int s = 0; s < spec.shards_size(); ++s) {
    spec.mutable_shards(s)->set_address(c.peers[s]);
  }
  return spec;
}

void ClusterSpecs() {
  v1::ClusterSpec a = Spec(Config(2, 0), 1000);
  v1::ClusterSpec b = a;
  b.mutable_optimizer()->set_lr(0.5f);
  b.set_index_codec("delta-bitpack");
  const std::string sa = a.SerializeAsString();
  Write("cluster_spec_fuzz", "same", U32(1) + U16(sa.size()) + sa + sa);
  Write("cluster_spec_fuzz", "lr_and_codec_differ",
        U32(3) + U16(sa.size()) + sa + b.SerializeAsString());
  v1::ClusterSpec one = Spec(Config(1, 0), 7);
  one.set_mode(v1::MODE_DENSE);
  const std::string so = one.SerializeAsString();
  Write("cluster_spec_fuzz", "one_shard_dense", U32(0) + U16(so.size()) + so);
}

std::string Record(int type, const google::protobuf::Message& m) {
  const std::string bytes = m.SerializeAsString();
  return std::string(1, static_cast<char>(type)) + U16(bytes.size()) + bytes;
}

void Requests() {
  // server_requests_fuzz's record types (its enum Record).
  enum {
    kJoin,
    kGetClusterSpec,
    kCommitStep,
    kExchangeThreshold,
    kGetShardState,
    kRollbackShard,
    kRecover,
    kAbortStep,
    kCheckMember,
    kPush,
    kInitChunk
  };
  struct Setting {
    const char* name;
    AggregationMode mode;
    SelectionKind selection;
    IndexCodec index;
    ValueCodec value;
  };
  const Setting settings[] = {
      {"gtopk_threshold_varint_fp32", AggregationMode::kGtopk,
       SelectionKind::kThreshold, IndexCodec::kDeltaVarint, ValueCodec::kFp32},
      {"gtopk_quota_bitpack_fp16", AggregationMode::kGtopk,
       SelectionKind::kQuota, IndexCodec::kDeltaBitpack, ValueCodec::kFp16},
      {"topk_raw_bf16", AggregationMode::kTopk, SelectionKind::kThreshold,
       IndexCodec::kRaw, ValueCodec::kBf16},
      {"dense", AggregationMode::kDense, SelectionKind::kThreshold,
       IndexCodec::kDeltaVarint, ValueCodec::kFp32},
  };
  const uint64_t n = 100;  // "more" byte 6: kLengths[2], parameters set
  for (const Setting& s : settings) {
    const int code =
        static_cast<int>(s.mode) + 3 * static_cast<int>(s.selection) +
        6 * static_cast<int>(s.index) + 18 * static_cast<int>(s.value);
    std::string in{static_cast<char>(code), '\x06'};
    v1::JoinRequest join;
    join.set_requested_rank(-1);
    join.set_n(n);
    in += Record(kJoin, join);
    in += Record(kGetClusterSpec, v1::JoinRequest());
    v1::Push push;
    push.set_step(0);
    push.set_rank(0);
    push.set_shard_id(0);
    push.set_member_token(1);
    push.set_cluster_fingerprint(1);
    if (s.mode == AggregationMode::kDense) {
      for (uint64_t i = 0; i < n; ++i) push.add_dense(0.01f * i);
    } else {
      push.set_sparse(Encode(Example(n), n, CodecSpec{s.index, s.value}));
    }
    in += Record(kPush, push);
    v1::ThresholdRequest threshold;
    threshold.set_step(1);
    threshold.set_k(1);
    threshold.set_cluster_fingerprint(1);
    for (int b = 0; b < 2048; ++b) threshold.add_histogram(b == 1000 ? 3 : 0);
    in += Record(kExchangeThreshold, threshold);
    v1::CommitRequest commit;
    commit.set_step(1);
    commit.set_cluster_fingerprint(1);
    in += Record(kCommitStep, commit);
    v1::ShardStateRequest state;
    state.set_cluster_fingerprint(1);
    state.set_without_settling(true);
    in += Record(kGetShardState, state);
    v1::RollbackRequest rollback;
    rollback.set_step(0);
    rollback.set_cluster_fingerprint(1);
    in += Record(kRollbackShard, rollback);
    v1::MemberCheckRequest member;
    member.set_rank(0);
    member.set_member_token(1);
    member.set_cluster_fingerprint(1);
    in += Record(kCheckMember, member);
    v1::RecoverRequest recover;
    recover.set_rank(0);
    recover.set_member_token(1);
    recover.set_cluster_fingerprint(1);
    in += Record(kRecover, recover);
    v1::AbortStepRequest abort;
    abort.set_step(2);
    abort.set_reason("seed");
    in += Record(kAbortStep, abort);
    Write("server_requests_fuzz", s.name, in);
  }
  // Rank 0's InitParams: two chunks covering [0, 100) ("more" byte 2).
  std::string init{'\x00', '\x02'};
  for (uint64_t offset : {0u, 60u}) {
    v1::ParamsChunk chunk;
    chunk.set_offset(offset);
    chunk.set_member_token(1);
    for (uint64_t i = offset; i < std::min<uint64_t>(offset + 60, n); ++i) {
      chunk.add_values(0.5f * i);
    }
    init += Record(kInitChunk, chunk);
  }
  Write("server_requests_fuzz", "init_params", init);
  // Bytes that parse as no request (issue 42): a bad wire type, a truncated
  // varint, a length past the end, and 101 nested groups, each sent as every
  // record type after a Join.
  const std::string malformed[] = {
      std::string("\x0f", 1),      // field 1, wire type 7
      std::string("\x08\xff", 2),  // varint whose continuation is cut
      std::string("\x0a\x10"
                  "a",
                  3),  // 16 bytes announced, 1 follows
      std::string(101, '\x0b') + std::string(101, '\x0c'),  // groups
  };
  const char* malformed_names[] = {"bad_wire_type", "truncated_varint",
                                   "length_past_end", "nested_groups"};
  for (size_t m = 0; m < 4; ++m) {
    std::string in{'\x00', '\x06'};
    v1::JoinRequest join;
    join.set_requested_rank(-1);
    join.set_n(n);
    in += Record(kJoin, join);
    for (int type = kJoin; type <= kInitChunk; ++type) {
      in += std::string(1, static_cast<char>(type)) + U16(malformed[m].size()) +
            malformed[m];
    }
    Write("server_requests_fuzz",
          absl::StrCat("malformed_", malformed_names[m]), in);
  }
}

void Checkpoints() {
  const std::string dir = out_root + "/.ckpt-tmp";
  ::mkdir(dir.c_str(), 0755);
  struct Case {
    const char* name;
    uint32_t shard, shards;
    uint64_t n, begin, end;
    bool velocity;
  };
  for (const Case& k : {Case{"shard0_of1", 0, 1, 5, 0, 5, false},
                        Case{"shard1_of2_velocity", 1, 2, 9, 4, 9, true},
                        Case{"empty_range", 2, 3, 2, 2, 2, false}}) {
    server::ShardCheckpoint c;
    c.shard_id = k.shard;
    c.num_shards = k.shards;
    c.n = k.n;
    c.begin = k.begin;
    c.end = k.end;
    c.next_step = 42;
    c.cluster_fingerprint = 0x5eed5eed5eed5eedull;  // the cluster identity
    c.run_id = 0x0123456789abcdefull;
    for (uint64_t i = k.begin; i < k.end; ++i) c.params.push_back(0.5f * i - 1);
    if (k.velocity) c.global_velocity.assign(c.params.size(), 0.125f);
    if (!server::WriteCheckpoint(dir, c).ok()) std::exit(1);
    std::string bytes;
    std::FILE* f =
        std::fopen(server::CheckpointPath(dir, k.shard).c_str(), "rb");
    char buf[4096];
    size_t got;
    while ((got = std::fread(buf, 1, sizeof buf, f)) > 0)
      bytes.append(buf, got);
    std::fclose(f);
    std::remove(server::CheckpointPath(dir, k.shard).c_str());
    // Control byte: the shard id the reader expects, CRC left as written.
    Write("checkpoint_fuzz", k.name,
          std::string(1, static_cast<char>(k.shard << 1)) + bytes);
  }
  ::rmdir(dir.c_str());
}

std::string BigEndian(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16),
          static_cast<char>(v >> 8), static_cast<char>(v)};
}

void Idx() {
  std::string images =
      BigEndian(0x803) + BigEndian(2) + BigEndian(28) + BigEndian(28);
  for (int i = 0; i < 2 * 28 * 28; ++i) images += static_cast<char>(i % 251);
  std::string labels = BigEndian(0x801) + BigEndian(3) + std::string{7, 0, 9};
  Write("idx_reader_fuzz", "images_plain", std::string(1, '\x00') + images);
  Write("idx_reader_fuzz", "images_gzip", std::string(1, '\x02') + images);
  Write("idx_reader_fuzz", "labels_plain", std::string(1, '\x01') + labels);
  Write("idx_reader_fuzz", "labels_gzip", std::string(1, '\x03') + labels);
}

void Flags() {
  auto w = [](const char* name, char which, const std::string& value) {
    Write("flag_values_fuzz", name, std::string{which, '\x0d'} + value);
  };
  w("listen", 0, "0.0.0.0:8470");
  w("peer_ipv6", 1, "[::1]:8471");
  w("codec", 2, "delta-bitpack");
  w("mode", 3, "threshold");
  w("argv", 4,
    std::string("gtopk-server\0--shard-id=1\0--num_shards\0002\0--\0-x-y", 48));
  w("density_warmup", 5, "0.25,0.0625");
  w("density_warmup_dgc", 6, "dgc");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUT_DIR (e.g. fuzz/corpus)\n");
    return 2;
  }
  out_root = argv[1];
  Codecs();
  ClusterSpecs();
  Requests();
  Checkpoints();
  Idx();
  Flags();
  return 0;
}
