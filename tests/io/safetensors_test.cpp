#include "lattice/io/safetensors.h"

#include <cmath>
#include <cstring>

#include <gtest/gtest.h>

#include "lattice/core/dtype.h"
#include "test_util.h"

namespace lattice::io {
namespace {

using testing::read_text;
using testing::TempDir;
using testing::write_text;

// A safetensors file image: 8-byte length, header text, then `data_bytes` bytes.
std::string image(const std::string& header, size_t data_bytes) {
  uint64_t n = header.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  out += header;
  out.append(data_bytes, '\0');
  return out;
}

SafeTensorsHeader parse_image(const std::string& bytes, bool allow_unsupported = false) {
  return parse_safetensors_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "m.safetensors",
                                  allow_unsupported);
}

TEST(SafeTensors, RoundTripAllDtypesScalarsAndEmptyTensors) {
  TempDir dir;
  std::vector<float> w(6);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.25f * static_cast<float>(i) - 0.5f;
  std::vector<uint16_t> w_bf16(6), w_f16(6);
  for (size_t i = 0; i < 6; ++i) {
    w_bf16[i] = f32_to_bf16(w[i]);
    w_f16[i] = f32_to_f16(w[i]);
  }
  float scalar = 3.5f;
  uint16_t odd_f16 = f32_to_f16(-2.0f);

  SafeTensorsWriter writer;
  writer.add("h.0.attn.c_attn.weight", DType::F32, {2, 3}, w.data());
  writer.add("b.bf16", DType::BF16, {3, 2}, w_bf16.data());
  writer.add("c.f16", DType::F16, {6}, w_f16.data());
  writer.add("scalar", DType::F32, {}, &scalar);
  writer.add("empty", DType::F32, {0, 4}, nullptr);
  writer.add("odd", DType::F16, {1}, &odd_f16);  // 2 bytes: the next tensor starts at an odd multiple of 2
  writer.add("after_odd", DType::F32, {2}, w.data());
  writer.set_metadata("format", "pt");
  writer.set_metadata("step", "120");
  std::string path = dir / "model.safetensors";
  writer.write(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, read_text(path).data(), 8);
  EXPECT_EQ(header_len % 8, 0u) << "data region must start 8-byte aligned";

  SafeTensorsReader reader(path);
  ASSERT_EQ(reader.tensors().size(), 7u);
  EXPECT_EQ(reader.tensors()[0].name, "h.0.attn.c_attn.weight");  // insertion order
  EXPECT_EQ(reader.tensors()[3].name, "scalar");
  EXPECT_EQ(reader.metadata().at("format"), "pt");
  EXPECT_EQ(reader.metadata().at("step"), "120");

  std::vector<float> out(6);
  reader.read_f32("h.0.attn.c_attn.weight", out.data(), std::vector<int64_t>{2, 3});
  EXPECT_EQ(out, w);
  reader.read_f32("b.bf16", out.data(), 6);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(out[i], bf16_to_f32(w_bf16[i]));
  reader.read_f32("c.f16", out.data(), 6);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(out[i], f16_to_f32(w_f16[i]));
  float s = 0;
  reader.read_f32("scalar", &s, std::vector<int64_t>{});
  EXPECT_EQ(s, 3.5f);
  EXPECT_EQ(reader.find("scalar")->numel(), 1);
  EXPECT_EQ(reader.find("empty")->numel(), 0);
  reader.read_f32("empty", nullptr, 0);
  reader.read_f32("odd", &s, 1);
  EXPECT_EQ(s, -2.0f);
  reader.read_f32("after_odd", out.data(), 2);
  EXPECT_EQ(out[1], w[1]);
  EXPECT_EQ(reader.find("c.f16")->dtype, DType::F16);
  EXPECT_EQ(reader.find("c.f16")->dtype_name, "F16");
  EXPECT_EQ(reader.find("missing"), nullptr);
  EXPECT_EQ(std::memcmp(reader.raw("b.bf16"), w_bf16.data(), 12), 0);

  EXPECT_ERROR_CONTAINS(reader.read_f32("missing", out.data(), 6),
                        "no tensor \"missing\" in safetensors file '" + path + "'");
  EXPECT_ERROR_CONTAINS(reader.read_f32("c.f16", out.data(), 5), "has shape [6] (6 elements), expected 5 elements");
  EXPECT_ERROR_CONTAINS(reader.read_f32("b.bf16", out.data(), std::vector<int64_t>{2, 3}),
                        "tensor \"b.bf16\" has shape [3, 2], expected [2, 3]");
}

TEST(SafeTensors, WriterLeavesNoTemporaryFileAndReplacesAtomically) {
  TempDir dir;
  float x = 1;
  SafeTensorsWriter a;
  a.add("x", DType::F32, {1}, &x);
  a.write(dir / "m.safetensors");
  x = 2;
  a.write(dir / "m.safetensors");
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir.path())) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
  float y = 0;
  SafeTensorsReader(dir / "m.safetensors").read_f32("x", &y, 1);
  EXPECT_EQ(y, 2.0f);
}

TEST(SafeTensors, WriterRejectsBadInput) {
  float x = 0;
  SafeTensorsWriter w;
  w.add("x", DType::F32, {1}, &x);
  EXPECT_ERROR_CONTAINS(w.add("x", DType::F32, {1}, &x), "tensor \"x\" added twice");
  EXPECT_ERROR_CONTAINS(w.add("", DType::F32, {1}, &x), "name must not be empty");
  EXPECT_ERROR_CONTAINS(w.add("__metadata__", DType::F32, {1}, &x), "reserved");
  EXPECT_ERROR_CONTAINS(w.add("neg", DType::F32, {-1}, &x), "negative dimension");
  EXPECT_ERROR_CONTAINS(w.write("/nonexistent-dir/m.safetensors"), "cannot create '/nonexistent-dir/m.safetensors.tmp.");
}

TEST(SafeTensors, ReadsAHandWrittenFile) {
  // As written by Hugging Face's library: sorted names, metadata first, padding spaces.
  std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"BF16","shape":[1,1],"data_offsets":[8,10]}}   )";
  std::string bytes = image(header, 10);
  float one = 1.0f, two = 2.0f;
  uint16_t three = f32_to_bf16(3.0f);
  size_t data = 8 + header.size();
  std::memcpy(&bytes[data], &one, 4);
  std::memcpy(&bytes[data + 4], &two, 4);
  std::memcpy(&bytes[data + 8], &three, 2);
  TempDir dir;
  write_text(dir / "hf.safetensors", bytes);
  SafeTensorsReader r(dir / "hf.safetensors");
  float out[2];
  r.read_f32("a", out, 2);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 2.0f);
  r.read_f32("b", out, 1);
  EXPECT_EQ(out[0], 3.0f);
}

TEST(SafeTensors, UnsupportedDtypesOnlyWhenListing) {
  std::string h = R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})";
  EXPECT_ERROR_CONTAINS(parse_image(image(h, 16)),
                        "safetensors file 'm.safetensors': tensor \"ids\": dtype I64 is not supported "
                        "(lattice reads F32, BF16, F16)");
  SafeTensorsHeader listed = parse_image(image(h, 16), true);
  ASSERT_EQ(listed.tensors.size(), 1u);
  EXPECT_FALSE(listed.tensors[0].supported);
  EXPECT_EQ(listed.tensors[0].dtype_name, "I64");

  TempDir dir;
  write_text(dir / "i.safetensors", image(h, 16));
  SafeTensorsReader r(dir / "i.safetensors", /*allow_unsupported_dtypes=*/true);
  float out[2];
  EXPECT_ERROR_CONTAINS(r.read_f32("ids", out, 2), "tensor \"ids\" has dtype I64, which lattice cannot read");
  EXPECT_ERROR_CONTAINS(SafeTensorsReader(dir / "i.safetensors"), "dtype I64 is not supported");
}

// Each malformed header gives its own message naming the file and the tensor/field.
TEST(SafeTensors, MalformedHeaders) {
  auto entry = [](const std::string& dtype, const std::string& shape, const std::string& offsets) {
    return R"({"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}";
  };
  struct Case {
    std::string bytes;
    std::string message;
  };
  std::string good_w = entry("F32", "[2]", "[0,8]");
  std::vector<Case> cases;
  {
    uint64_t huge = 200ull * 1000 * 1000;
    std::string b(reinterpret_cast<const char*>(&huge), 8);
    cases.push_back({b + "{}", "header length 200000000 exceeds the limit of 100000000 bytes"});
    uint64_t too_long = 50;
    std::string c(reinterpret_cast<const char*>(&too_long), 8);
    cases.push_back({c + "{}", "header length 50 exceeds the file size (10 bytes): file truncated or not safetensors"});
  }
  cases.push_back({"abc", "file is too short (3 bytes"});
  cases.push_back({image("[1,2]", 0), "header does not start with '{'"});
  cases.push_back({image("{\"w\":", 0), "safetensors file 'm.safetensors' header: invalid JSON at line 1 column 6"});
  cases.push_back({image(R"({"w":)" + good_w + ",}", 8), "invalid JSON"});
  cases.push_back({image(R"({"w":)" + entry("Q7", "[2]", "[0,8]") + "}", 8),
                   "tensor \"w\": unknown dtype \"Q7\" (lattice reads F32, BF16, F16)"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[3]", "[0,8]") + "}", 8),
                   "tensor \"w\": shape [3] x F32 needs 12 bytes but data_offsets [0, 8] span 8"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[2]", "[0,16]") + "}", 8),
                   "tensor \"w\": data_offsets [0, 16] extend past the end of the data region (8 bytes): file "
                   "truncated?"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[2]", "[8,0]") + "}", 8),
                   "tensor \"w\": data_offsets [8, 0] end before they begin"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[2]", "[-1,7]") + "}", 8),
                   "tensor \"w\": data_offsets[0] must be a non-negative integer that fits uint64, got -1"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[2]", "[0,18446744073709551616]") + "}", 8),
                   "data_offsets[1] must be a non-negative integer that fits uint64, got 18446744073709551616"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[2]", "[0.0,8]") + "}", 8),
                   "data_offsets[0] must be a non-negative integer"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[2]", "[0]") + "}", 8),
                   "tensor \"w\": \"data_offsets\" must be an array [begin, end]"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[-2]", "[0,8]") + "}", 8),
                   "tensor \"w\": shape[0] must be a non-negative integer that fits int64, got -2"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[\"2\"]", "[0,8]") + "}", 8),
                   "tensor \"w\": shape[0] must be a non-negative integer that fits int64, got \"2\""});
  cases.push_back({image(R"({"w":)" + entry("F32", "[4294967296,4294967296]", "[0,8]") + "}", 8),
                   "tensor \"w\": shape [4294967296, 4294967296] is too large"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[2]", "[0,8]") + R"(,"v":)" + entry("F32", "[2]", "[4,12]") + "}", 12),
                   "tensor \"v\" data_offsets [4, 12] overlap tensor \"w\" [0, 8]"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[2]", "[0,8]") + R"(,"v":)" + entry("F32", "[2]", "[0,8]") + "}", 8),
                   "overlap"});
  cases.push_back({image(R"({"w":)" + entry("F32", "[2]", "[4,12]") + "}", 12),
                   "gap in the data region between byte 0 and tensor \"w\" at [4, 12]"});
  cases.push_back({image(R"({"w":)" + good_w + "}", 9),
                   "data region is 9 bytes but the tensors cover 8 (trailing bytes after the last tensor)"});
  cases.push_back({image(R"({"w":)" + good_w + R"(,"w":)" + good_w + "}", 8), "duplicate tensor name \"w\""});
  cases.push_back({image(R"({"":)" + good_w + "}", 8), "empty tensor name"});
  cases.push_back({image(R"({"w":[1]})", 0), "tensor \"w\": entry must be an object with dtype, shape and data_offsets"});
  cases.push_back({image(R"({"w":{"dtype":"F32","shape":[2]}})", 8), "tensor \"w\": missing field \"data_offsets\""});
  cases.push_back({image(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", 8), "tensor \"w\": missing field \"dtype\""});
  cases.push_back({image(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", 8), "tensor \"w\": missing field \"shape\""});
  cases.push_back({image(R"({"w":{"dtype":3,"shape":[2],"data_offsets":[0,8]}})", 8), "tensor \"w\": \"dtype\" must be a string"});
  cases.push_back({image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}})", 8),
                   "tensor \"w\": unexpected field \"extra\""});
  cases.push_back({image(R"({"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
                   "tensor \"w\": duplicate field \"dtype\""});
  cases.push_back({image(R"({"__metadata__":{"k":1}})", 0), "\"__metadata__\" value for \"k\" must be a string"});
  cases.push_back({image(R"({"__metadata__":[]})", 0), "\"__metadata__\" must be an object of strings"});
  cases.push_back({image(R"({"__metadata__":{},"__metadata__":{}})", 0), "duplicate \"__metadata__\""});
  cases.push_back({image(R"({"__metadata__":{"k":"a","k":"b"}})", 0), "duplicate \"__metadata__\" key \"k\""});

  for (const Case& c : cases) {
    std::string msg = testing::error_of([&] { parse_image(c.bytes); });
    EXPECT_NE(msg.find(c.message), std::string::npos) << "got: " << msg << "\nwant: " << c.message;
    EXPECT_NE(msg.find("safetensors file 'm.safetensors'"), std::string::npos) << msg;
  }
}

TEST(SafeTensors, ReaderErrorsNameThePath) {
  TempDir dir;
  EXPECT_ERROR_CONTAINS(SafeTensorsReader(dir / "none.safetensors"),
                        "cannot open safetensors file '" + (dir / "none.safetensors") + "'");
  write_text(dir / "empty.safetensors", "");
  EXPECT_ERROR_CONTAINS(SafeTensorsReader(dir / "empty.safetensors"),
                        "safetensors file '" + (dir / "empty.safetensors") + "': file is too short (0 bytes");
  // Truncated data: a valid file cut short.
  std::vector<float> w(100, 1.0f);
  SafeTensorsWriter writer;
  writer.add("w", DType::F32, {100}, w.data());
  writer.write(dir / "full.safetensors");
  std::string bytes = read_text(dir / "full.safetensors");
  write_text(dir / "cut.safetensors", bytes.substr(0, bytes.size() - 1));
  EXPECT_ERROR_CONTAINS(SafeTensorsReader(dir / "cut.safetensors"),
                        "tensor \"w\": data_offsets [0, 400] extend past the end of the data region (399 bytes)");
  EXPECT_ERROR_CONTAINS(SafeTensorsReader(dir.path()), "not a regular file");
}

}  // namespace
}  // namespace lattice::io
