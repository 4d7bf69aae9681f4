// GPT-2 tokenizer: known ids, agreement with an independent implementation
// (fixture made by tools/make_tokenizer_fixture.js from the JS encoder of
// gpt-3-encoder@1.1.4), round trips, the heap BPE against the textbook one,
// load errors, and the encode speed (printed, not asserted).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <ctime>
#include <random>
#include <set>

#include "lattice/core/timer.h"
#include "lattice/data/paths.h"
#include "lattice/data/pretokenize.h"
#include "lattice/data/tokenizer.h"
#include "lattice/data/unicode.h"
#include "test_util.h"

namespace lattice::data {
namespace {

using testing::expect_error;
using testing::shared_tokenizer;

TEST(Unicode, ClassesOfSampleCharacters) {
  using unicode::CharClass;
  using unicode::classify;
  EXPECT_EQ(classify('a'), CharClass::kLetter);
  EXPECT_EQ(classify(0xE9), CharClass::kLetter);    // é
  EXPECT_EQ(classify(0x416), CharClass::kLetter);   // Ж
  EXPECT_EQ(classify(0x4E2D), CharClass::kLetter);  // 中
  EXPECT_EQ(classify(0x1C5), CharClass::kLetter);   // ǅ (Lt)
  EXPECT_EQ(classify(0x2B0), CharClass::kLetter);   // ʰ (Lm)
  EXPECT_EQ(classify(0x20000), CharClass::kLetter); // 𠀀 (CJK extension B, outside the BMP)
  EXPECT_EQ(classify('7'), CharClass::kNumber);
  EXPECT_EQ(classify(0xBD), CharClass::kNumber);    // ½ (No)
  EXPECT_EQ(classify(0x663), CharClass::kNumber);   // ٣ (Nd)
  EXPECT_EQ(classify(0x216B), CharClass::kNumber);  // Ⅻ (Nl)
  EXPECT_EQ(classify(' '), CharClass::kSpace);
  EXPECT_EQ(classify('\n'), CharClass::kSpace);
  EXPECT_EQ(classify(0x85), CharClass::kSpace);
  EXPECT_EQ(classify(0xA0), CharClass::kSpace);
  EXPECT_EQ(classify(0x3000), CharClass::kSpace);
  EXPECT_EQ(classify(0xFEFF), CharClass::kOther);   // not White_Space (JavaScript's \s has it)
  EXPECT_EQ(classify(0x200B), CharClass::kOther);   // zero-width space is not White_Space
  EXPECT_EQ(classify('\''), CharClass::kOther);
  EXPECT_EQ(classify(0x301), CharClass::kOther);    // combining acute (Mn) is not \p{L}
  EXPECT_EQ(classify(0x1F642), CharClass::kOther);  // 🙂
  EXPECT_EQ(classify(0x110000), CharClass::kOther);
}

TEST(Unicode, DecodeUtf8RejectsInvalidSequences) {
  auto dec = [](const std::string& s, int* len) {
    return unicode::decode_utf8(reinterpret_cast<const unsigned char*>(s.data()), s.size(), len);
  };
  int len;
  EXPECT_EQ(dec("\xC3\xA9", &len), 0xE9u);
  EXPECT_EQ(len, 2);
  EXPECT_EQ(dec("\xF0\x9F\x99\x82", &len), 0x1F642u);
  EXPECT_EQ(len, 4);
  for (std::string bad : {"\xC3", "\xC0\xAF", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\x80", "\xFF", "\xE2\x28\xA1"}) {
    EXPECT_EQ(dec(bad, &len), unicode::kInvalid) << "bytes of length " << bad.size();
    EXPECT_EQ(len, 1);
  }
}

TEST(PreTokenizer, SplitsLikeGpt2Pattern) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pretokenize("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pretokenize("I'm here's"), (V{"I", "'m", " here", "'s"}));
  EXPECT_EQ(pretokenize("I'M"), (V{"I", "'", "M"}));  // contractions are case-sensitive
  EXPECT_EQ(pretokenize("'sam"), (V{"'s", "am"}));
  EXPECT_EQ(pretokenize("a  b"), (V{"a", " ", " b"}));
  EXPECT_EQ(pretokenize("a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(pretokenize("a \n b"), (V{"a", " \n", " b"}));
  EXPECT_EQ(pretokenize("a\nb"), (V{"a", "\n", "b"}));
  EXPECT_EQ(pretokenize("end  "), (V{"end", "  "}));
  EXPECT_EQ(pretokenize("abc123def"), (V{"abc", "123", "def"}));
  EXPECT_EQ(pretokenize(" 123 !!? x"), (V{" 123", " !!?", " x"}));
  EXPECT_EQ(pretokenize("\"'s"), (V{"\"'", "s"}));
  EXPECT_EQ(pretokenize("x\u00a0y"), (V{"x", "\u00a0", "y"}));  // only U+0020 joins the next word
  EXPECT_EQ(pretokenize("caf\xC3\xA9 na\xC3\xAFve"), (V{"caf\xC3\xA9", " na\xC3\xAFve"}));
  EXPECT_EQ(pretokenize("e\xCC\x81t\xC3\xA9"), (V{"e", "\xCC\x81", "t\xC3\xA9"}));
  EXPECT_EQ(pretokenize("\xFF\xFEok"), (V{"\xFF\xFE", "ok"}));  // invalid bytes are "other"
  EXPECT_EQ(pretokenize(""), V{});
}

TEST(PreTokenizer, PiecesCoverRandomBytes) {
  std::mt19937 gen(7);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string s(gen() % 64, '\0');
    for (char& c : s) c = static_cast<char>(gen() % 4 == 0 ? " \n'a1"[gen() % 5] : gen() % 256);
    std::string joined;
    for (const auto& p : pretokenize(s)) {
      ASSERT_FALSE(p.empty());
      joined += p;
    }
    ASSERT_EQ(joined, s);
  }
}

TEST(Tokenizer, ByteToUnicodeTable) {
  std::vector<uint32_t> t = gpt2_byte_to_unicode();
  EXPECT_EQ(t['!'], uint32_t('!'));
  EXPECT_EQ(t[' '], 0x120u);  // 'Ġ', GPT-2's visible space
  EXPECT_EQ(t['\n'], 0x10Au);  // 'Ċ'
  EXPECT_EQ(t[0], 0x100u);
  EXPECT_EQ(t[0xAD], 0x143u);
  std::set<uint32_t> distinct(t.begin(), t.end());
  EXPECT_EQ(distinct.size(), 256u);
}

TEST(Tokenizer, KnownIds) {
  LATTICE_REQUIRE_VOCAB();
  const Tokenizer& tok = *shared_tokenizer();
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.eot(), 50256);
  EXPECT_EQ(tok.encode(" the"), std::vector<int>{262});
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<int>{15496, 995}));
  EXPECT_EQ(tok.encode(""), std::vector<int>{});
  EXPECT_EQ(tok.decode_token(50256), "<|endoftext|>");
  EXPECT_EQ(tok.decode_token(262), " the");
  EXPECT_EQ(tok.decode({15496, 995}), "Hello world");
  // The literal text is ordinary text to encode(), not the special token.
  std::vector<int> ids = tok.encode("<|endoftext|>");
  EXPECT_GT(ids.size(), 1u);
  EXPECT_EQ(tok.decode(ids), "<|endoftext|>");
}

TEST(Tokenizer, DecodeRejectsIdsOutsideVocabulary) {
  LATTICE_REQUIRE_VOCAB();
  const Tokenizer& tok = *shared_tokenizer();
  expect_error([&] { tok.decode_token(50257); }, {"token id 50257", "[0, 50257)"});
  expect_error([&] { tok.decode({1, -1}); }, {"token id -1"});
}

// Reads the fixture written by tools/make_tokenizer_fixture.js.
struct FixtureCase {
  std::string name, text;
  std::vector<int> ids;
};

std::vector<FixtureCase> read_fixture(const std::string& corpus) {
  std::string bytes = testing::read_file(testing::source_dir() + "/tests/data/fixtures/tokenizer_fixture.bin");
  size_t pos = 0;
  auto need = [&](size_t n) {
    if (pos + n > bytes.size()) throw std::runtime_error("tokenizer fixture is truncated");
  };
  auto u32 = [&] {
    need(4);
    uint32_t v;
    std::memcpy(&v, bytes.data() + pos, 4);
    pos += 4;
    return v;
  };
  auto str = [&](size_t n) {
    need(n);
    std::string s = bytes.substr(pos, n);
    pos += n;
    return s;
  };
  if (str(8) != "LTKFIX01") throw std::runtime_error("tokenizer fixture has a bad magic");
  std::vector<FixtureCase> cases(u32());
  for (auto& c : cases) {
    need(1);
    uint8_t kind = static_cast<uint8_t>(bytes[pos++]);
    c.name = str(u32());
    if (kind == 0) {
      c.text = str(u32());
    } else {
      uint32_t offset = u32(), length = u32();
      if (uint64_t(offset) + length > corpus.size()) throw std::runtime_error("fixture slice outside the corpus");
      c.text = corpus.substr(offset, length);
    }
    uint32_t n = u32();
    need(2 * size_t(n));
    c.ids.resize(n);
    for (uint32_t i = 0; i < n; ++i) {
      uint16_t id;
      std::memcpy(&id, bytes.data() + pos + 2 * i, 2);
      c.ids[i] = id;
    }
    pos += 2 * size_t(n);
  }
  if (pos != bytes.size()) throw std::runtime_error("tokenizer fixture has trailing bytes");
  return cases;
}

TEST(Tokenizer, AgreesWithIndependentJsEncoder) {
  LATTICE_REQUIRE_VOCAB();
  LATTICE_REQUIRE_CORPUS();
  const Tokenizer& tok = *shared_tokenizer();
  std::vector<FixtureCase> cases = read_fixture(testing::read_file(testing::corpus_path()));
  ASSERT_GT(cases.size(), 300u);
  size_t bytes = 0, ids = 0;
  for (const auto& c : cases) {
    std::vector<int> got = tok.encode(c.text);
    if (got != c.ids) {
      size_t i = 0;
      while (i < got.size() && i < c.ids.size() && got[i] == c.ids[i]) ++i;
      ADD_FAILURE() << "case '" << c.name << "': first difference at token " << i << " (lattice "
                    << (i < got.size() ? tok.decode_token(got[i]) : "<end>") << " vs reference "
                    << (i < c.ids.size() ? tok.decode_token(c.ids[i]) : "<end>") << ")";
    }
    bytes += c.text.size();
    ids += c.ids.size();
  }
  std::printf("[ fixture  ] %zu cases, %zu bytes, %zu tokens agree with gpt-3-encoder@1.1.4 (JS)\n", cases.size(),
              bytes, ids);
}

TEST(Tokenizer, HeapMergeEqualsReferenceOnCorpusPieces) {
  LATTICE_REQUIRE_VOCAB();
  LATTICE_REQUIRE_CORPUS();
  const Tokenizer& tok = *shared_tokenizer();
  ASSERT_TRUE(tok.uses_heap_merge());  // otherwise this compares the reference with itself
  std::string corpus = testing::read_file(testing::corpus_path());
  std::set<std::string> pieces;
  PreTokenizer it(corpus);
  std::string_view piece;
  while (it.next(&piece)) pieces.emplace(piece);
  std::mt19937 gen(3);
  for (int i = 0; i < 500; ++i) {  // and long or random pieces
    std::string s(1 + gen() % 300, '\0');
    for (char& c : s) c = static_cast<char>(gen() % 3 == 0 ? "aeiou =-"[gen() % 8] : gen() % 256);
    pieces.insert(s);
  }
  for (const std::string& text : pieces) {
    // Random strings are several pieces; the reference runs piece by piece.
    std::vector<int> reference;
    for (const std::string& p : pretokenize(text)) {
      std::vector<int> ids = tok.encode_piece_reference(p);
      reference.insert(reference.end(), ids.begin(), ids.end());
    }
    ASSERT_EQ(tok.encode(text), reference) << "text '" << text << "'";
  }
}

// CPU time of this thread: the speed of one core even on a busy machine.
double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

TEST(Tokenizer, CorpusRoundTripAndSpeed) {
  LATTICE_REQUIRE_VOCAB();
  LATTICE_REQUIRE_CORPUS();
  std::string corpus = testing::read_file(testing::corpus_path());
  ASSERT_EQ(corpus.size(), 1204997u);
  // A fresh tokenizer, so the first pass starts with an empty cache.
  Tokenizer tok = Tokenizer::load(testing::tokenizer_dir());
  Timer cold;
  double cpu0 = thread_cpu_seconds();
  std::vector<int> ids = tok.encode(corpus);
  double cold_s = cold.seconds(), cold_cpu = thread_cpu_seconds() - cpu0;
  Timer warm;
  double cpu1 = thread_cpu_seconds();
  std::vector<int> again = tok.encode(corpus);
  double warm_s = warm.seconds(), warm_cpu = thread_cpu_seconds() - cpu1;
  EXPECT_EQ(ids, again);
  Timer dec;
  std::string text = tok.decode(ids);
  double dec_s = dec.seconds();
  EXPECT_TRUE(text == corpus) << "decode(encode(corpus)) differs from the corpus";
  EXPECT_GT(ids.size(), 300000u);
  EXPECT_LT(ids.size(), 340000u);
  const double mb = corpus.size() / 1e6;
  std::printf("[ speed    ] Moby-Dick %.2f MB -> %zu tokens, one thread; encode: cold cache %.1f MB/s of CPU time "
              "(%.1f MB/s wall), warm cache %.1f MB/s CPU (%.1f wall); decode %.1f MB/s wall\n",
              mb, ids.size(), mb / cold_cpu, mb / cold_s, mb / warm_cpu, mb / warm_s, mb / dec_s);
}

TEST(Tokenizer, RoundTripsArbitraryBytes) {
  LATTICE_REQUIRE_VOCAB();
  const Tokenizer& tok = *shared_tokenizer();
  std::mt19937 gen(11);
  for (int trial = 0; trial < 500; ++trial) {
    std::string s(gen() % 200, '\0');
    for (char& c : s) c = static_cast<char>(gen() % 256);
    std::vector<int> ids = tok.encode(s);
    for (int id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size() && id != tok.eot());
    ASSERT_EQ(tok.decode(ids), s);
  }
}

TEST(Tokenizer, DefaultDirectoryFollowsLatticeHome) {
  const char* old = std::getenv("LATTICE_HOME");
  std::string saved = old ? old : "";
  ::setenv("LATTICE_HOME", "/some/where", 1);
  EXPECT_EQ(find_lattice_home(), "/some/where");
  EXPECT_EQ(default_tokenizer_dir(), "/some/where/.cache/gpt2");
  ::unsetenv("LATTICE_HOME");
  // Without it: found from the executable or the working directory, if at all.
  std::string dir = default_tokenizer_dir();
  EXPECT_EQ(dir.substr(dir.size() - 11), ".cache/gpt2");
  if (!find_lattice_home().empty()) {
    EXPECT_TRUE(std::filesystem::is_directory(dir)) << dir;
  }
  if (old) ::setenv("LATTICE_HOME", saved.c_str(), 1);
}

TEST(Tokenizer, LoadErrorsNameTheFile) {
  testing::TempDir dir;
  expect_error([&] { Tokenizer::load(dir.path()); }, {dir.path() + "/encoder.json", "not found", "run scripts/setup.sh"});
  testing::write_file(dir.file("encoder.json"), "{\"a\": 0, \"b\" 1}");
  testing::write_file(dir.file("vocab.bpe"), "#version: 0.2\n");
  expect_error([&] { Tokenizer::load(dir.path()); }, {dir.file("encoder.json"), "malformed JSON at byte 13", "expected ':'"});
  // A valid tiny encoder.json (every byte, EOT) but a broken vocab.bpe.
  std::vector<uint32_t> b2u = gpt2_byte_to_unicode();
  std::string json = "{";
  auto utf8 = [](uint32_t cp) {
    std::string s;
    if (cp < 0x80) s += char(cp);
    else s += char(0xC0 | (cp >> 6)), s += char(0x80 | (cp & 0x3F));
    return s;
  };
  for (int b = 0; b < 256; ++b) {
    std::string t = utf8(b2u[b]);
    if (t == "\"" || t == "\\") t = "\\" + t;
    json += "\"" + t + "\": " + std::to_string(b) + ", ";
  }
  json += "\"<|endoftext|>\": 256}";
  testing::write_file(dir.file("encoder.json"), json);
  testing::write_file(dir.file("vocab.bpe"), "#version: 0.2\na b c\n");
  expect_error([&] { Tokenizer::load(dir.path()); }, {dir.file("vocab.bpe"), "line 2", "two tokens"});
  testing::write_file(dir.file("vocab.bpe"), "#version: 0.2\na b\n");
  expect_error([&] { Tokenizer::load(dir.path()); }, {dir.file("vocab.bpe"), "'ab'", "not in encoder.json"});
  testing::write_file(dir.file("vocab.bpe"), "#version: 0.2\n");
  Tokenizer bytes_only = Tokenizer::load(dir.path());
  EXPECT_EQ(bytes_only.vocab_size(), 257);
  EXPECT_EQ(bytes_only.encode("hi"), (std::vector<int>{'h', 'i'}));
}

}  // namespace
}  // namespace lattice::data
