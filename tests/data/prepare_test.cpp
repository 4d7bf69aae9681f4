// `lattice prepare`: argument errors, document rules, block-wise encoding
// equal to whole-text encoding, shard layout and the train/val split.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "lattice/data/loader.h"
#include "lattice/data/prepare.h"
#include "lattice/data/shard.h"
#include "test_util.h"

namespace lattice::data {
namespace {

using testing::expect_error;
using testing::TempDir;
using Args = std::vector<std::string>;

TEST(PrepareArgs, ParsesOptions) {
  PrepareOptions o = parse_prepare_args(
      {"prepare", "--input", "a.txt", "b.txt", "--out", "dir", "--val-fraction", "0.25", "--shard-tokens", "2M",
       "--input=c.txt", "--tokenizer", "tok", "--overwrite"});
  EXPECT_EQ(o.inputs, (std::vector<std::string>{"a.txt", "b.txt", "c.txt"}));
  EXPECT_EQ(o.out_dir, "dir");
  EXPECT_DOUBLE_EQ(o.val_fraction, 0.25);
  EXPECT_EQ(o.shard_tokens, 2000000);
  EXPECT_EQ(o.tokenizer_dir, "tok");
  EXPECT_TRUE(o.overwrite);
  EXPECT_FALSE(o.help);
  PrepareOptions d = parse_prepare_args({"prepare", "--input", "x", "--out=o"});
  EXPECT_DOUBLE_EQ(d.val_fraction, 0.1);
  EXPECT_EQ(d.shard_tokens, 100000000);
  EXPECT_TRUE(parse_prepare_args({"prepare", "--help"}).help);
  EXPECT_NE(prepare_usage().find("--shard-tokens"), std::string::npos);
}

TEST(PrepareArgs, RefusesBadArguments) {
  expect_error([] { parse_prepare_args({"prepare", "--input", "a", "--out", "d", "--frobnicate"}); },
               {"prepare: unknown option '--frobnicate'", "valid: --input, --out"});
  expect_error([] { parse_prepare_args({"prepare", "--out", "d"}); }, {"--input FILE... is required"});
  expect_error([] { parse_prepare_args({"prepare", "--input", "a"}); }, {"--out DIR is required"});
  expect_error([] { parse_prepare_args({"prepare", "--input", "--out", "d"}); }, {"--input needs at least one FILE"});
  expect_error([] { parse_prepare_args({"prepare", "--input", "a", "--out"}); }, {"--out needs a value"});
  expect_error([] { parse_prepare_args({"prepare", "stray", "--input", "a", "--out", "d"}); },
               {"unexpected argument 'stray'"});
  for (std::string bad : {"1", "1.5", "-0.1", "abc", "", "nan"})
    expect_error([&] { parse_prepare_args({"prepare", "--input", "a", "--out", "d", "--val-fraction=" + bad}); },
                 {"--val-fraction must be a number in [0, 1), got '" + bad + "'"});
  for (std::string bad : {"0", "-5", "1.5", "x", "3G", "M"})
    expect_error([&] { parse_prepare_args({"prepare", "--input", "a", "--out", "d", "--shard-tokens", bad}); },
                 {"--shard-tokens must be a whole number of tokens in [1, 2147483647]", "got '" + bad + "'"});
}

TEST(Prepare, MissingInputFileIsNamed) {
  LATTICE_REQUIRE_VOCAB();
  TempDir dir;
  PrepareOptions o;
  o.inputs = {dir.file("there.txt"), dir.file("missing.txt")};
  testing::write_file(o.inputs[0], "hello");
  o.out_dir = dir.file("out");
  expect_error([&] { prepare_shards(o, *testing::shared_tokenizer(), nullptr); },
               {"prepare: input file " + dir.file("missing.txt") + " not found"});
  EXPECT_FALSE(std::filesystem::exists(dir.file("out/train_000000.bin")));
}

TEST(Prepare, DocumentRules) {
  LATTICE_REQUIRE_VOCAB();
  const Tokenizer& tok = *testing::shared_tokenizer();
  const int eot = tok.eot();
  auto enc = [&](const std::string& s) { return tok.encode(s); };
  auto cat = [](std::initializer_list<std::vector<int>> parts) {
    std::vector<int> out;
    for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
  };
  EXPECT_EQ(encode_documents("Hello world", tok, 1 << 20), cat({{eot}, enc("Hello world")}));
  EXPECT_EQ(encode_documents("one<|endoftext|>two", tok, 1 << 20), cat({{eot}, enc("one"), {eot}, enc("two")}));
  // Separators at the ends or in a row make no empty document.
  EXPECT_EQ(encode_documents("<|endoftext|>one<|endoftext|><|endoftext|>two<|endoftext|>", tok, 1 << 20),
            cat({{eot}, enc("one"), {eot}, enc("two"), {eot}}));
  EXPECT_EQ(encode_documents("", tok, 16), std::vector<int>{eot});
}

TEST(Prepare, BlockwiseEncodingEqualsWholeText) {
  LATTICE_REQUIRE_VOCAB();
  LATTICE_REQUIRE_CORPUS();
  const Tokenizer& tok = *testing::shared_tokenizer();
  std::string corpus = testing::read_file(testing::corpus_path());
  std::vector<int> whole = {tok.eot()};
  tok.encode_append(corpus, &whole);
  for (size_t block : {size_t(1000), size_t(4097), size_t(65536)})
    EXPECT_EQ(encode_documents(corpus, tok, block), whole) << "block " << block;
  // Text with cut-sensitive spots: spaces before newlines, runs of newlines, separators.
  std::string tricky;
  for (int i = 0; i < 300; ++i)
    tricky += "line " + std::to_string(i) + (i % 3 ? " \n" : "\n") + (i % 5 ? "x\n\n  y" : "<|endoftext|>z\n");
  std::vector<int> expected = encode_documents(tricky, tok, tricky.size());
  for (size_t block : {size_t(1), size_t(7), size_t(64)})
    EXPECT_EQ(encode_documents(tricky, tok, block), expected) << "block " << block;
  // One long line: no place to cut until the end.
  std::string line;
  for (int i = 0; i < 2000; ++i) line += "word" + std::to_string(i % 97) + (i % 13 ? " " : "  ");
  EXPECT_EQ(encode_documents(line, tok, 100), encode_documents(line, tok, line.size()));
}

TEST(Prepare, WritesShardsAndSplits) {
  LATTICE_REQUIRE_VOCAB();
  const Tokenizer& tok = *testing::shared_tokenizer();
  TempDir dir;
  std::string a, b;
  for (int i = 0; i < 200; ++i) a += "The whale swam past ship number " + std::to_string(i) + ".\n";
  for (int i = 0; i < 100; ++i) b += "Call me Ishmael, said voice " + std::to_string(i) + ".\n";
  testing::write_file(dir.file("a.txt"), a);
  testing::write_file(dir.file("b.txt"), b);
  PrepareOptions o;
  o.inputs = {dir.file("a.txt"), dir.file("b.txt")};
  o.out_dir = dir.file("out");
  o.val_fraction = 0.2;
  o.shard_tokens = 1000;
  o.read_block_bytes = 777;
  PrepareSummary s = prepare_shards(o, tok, nullptr);

  std::vector<int> stream = {tok.eot()};
  tok.encode_append(a, &stream);
  stream.push_back(tok.eot());
  tok.encode_append(b, &stream);
  const int64_t total = static_cast<int64_t>(stream.size());
  EXPECT_EQ(s.documents, 2);
  EXPECT_EQ(s.input_bytes, static_cast<int64_t>(a.size() + b.size()));
  EXPECT_EQ(s.val_tokens, std::llround(total * 0.2));
  EXPECT_EQ(s.train_tokens + s.val_tokens, total);
  ASSERT_EQ(s.train_files.size(), static_cast<size_t>((s.train_tokens + 999) / 1000));
  ASSERT_EQ(s.val_files.size(), static_cast<size_t>((s.val_tokens + 999) / 1000));
  EXPECT_EQ(s.train_files[0], dir.file("out/train_000000.bin"));
  EXPECT_EQ(s.val_files[0], dir.file("out/val_000000.bin"));
  std::vector<int> read_back;
  for (const auto& files : {s.train_files, s.val_files})
    for (const auto& f : files) {
      std::vector<uint16_t> t = read_shard(f, tok.vocab_size());
      EXPECT_LE(t.size(), 1000u);
      read_back.insert(read_back.end(), t.begin(), t.end());
    }
  EXPECT_EQ(read_back, stream);

  // The loader reads the train split as the same stream, across its shards.
  LoaderOptions lo;
  lo.pattern = o.out_dir + "/train_*.bin";
  lo.B = 3;
  lo.T = 400;  // windows span the 1000-token shards
  lo.shuffle = false;
  DataLoader loader(lo);
  EXPECT_EQ(loader.num_tokens(), s.train_tokens);
  std::vector<int32_t> in(3 * 400), tg(3 * 400);
  loader.next_batch(in.data(), tg.data());
  loader.next_batch(in.data(), tg.data());
  for (int i = 0; i < 3 * 400; ++i) {
    ASSERT_EQ(in[i], stream[1200 + i / 400 * 400 + i % 400]);
    ASSERT_EQ(tg[i], stream[1200 + i / 400 * 400 + i % 400 + 1]);
  }

  // A second run refuses to mix with the shards already there...
  expect_error([&] { prepare_shards(o, tok, nullptr); }, {"already holds", "train_000000.bin", "--overwrite"});
  // ...and with --overwrite replaces all of them (fewer shards now: no stale ones left).
  o.overwrite = true;
  o.shard_tokens = 100000;
  PrepareSummary s2 = prepare_shards(o, tok, nullptr);
  EXPECT_EQ(s2.train_files.size(), 1u);
  int shards = 0;
  for (auto& e : std::filesystem::directory_iterator(o.out_dir)) shards += e.path().extension() == ".bin";
  EXPECT_EQ(shards, 2);

  // No val split at all, and a val fraction too small to hold one token.
  o.val_fraction = 0;
  PrepareSummary s3 = prepare_shards(o, tok, nullptr);
  EXPECT_EQ(s3.val_tokens, 0);
  EXPECT_TRUE(s3.val_files.empty());
  testing::write_file(dir.file("tiny.txt"), "hi");
  o.inputs = {dir.file("tiny.txt")};
  o.val_fraction = 0.01;
  expect_error([&] { prepare_shards(o, tok, nullptr); }, {"--val-fraction 0.01 of 2 tokens is no token"});
}

}  // namespace
}  // namespace lattice::data
