#include "lattice/data/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "lattice/core/error.h"
#include "lattice/data/pretokenize.h"
#include "lattice/data/unicode.h"

namespace lattice::data {
namespace {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

std::string read_vocab_file(const std::string& path) {
  std::error_code ec;
  LATTICE_CHECK(std::filesystem::is_regular_file(path, ec),
                "tokenizer file " << path << " not found; run scripts/setup.sh to fetch the GPT-2 vocabulary");
  std::ifstream in(path, std::ios::binary);
  LATTICE_CHECK(in, "cannot open tokenizer file " << path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// A minimal reader for encoder.json: one object whose values are integers.
class JsonVocabReader {
 public:
  JsonVocabReader(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  std::vector<std::pair<std::string, int>> read() {
    std::vector<std::pair<std::string, int>> entries;
    skip_space();
    expect('{');
    skip_space();
    if (peek() == '}') {
      ++pos_;
    } else {
      while (true) {
        skip_space();
        std::string key = read_string();
        skip_space();
        expect(':');
        skip_space();
        int value = read_int();
        entries.emplace_back(std::move(key), value);
        skip_space();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        break;
      }
    }
    skip_space();
    if (pos_ != s_.size()) fail("unexpected text after the closing '}'");
    return entries;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    LATTICE_FAIL(path_ << ": malformed JSON at byte " << pos_ << ": " << what);
  }
  int peek() const { return pos_ < s_.size() ? static_cast<unsigned char>(s_[pos_]) : -1; }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) ++pos_;
  }
  void expect(char c) {
    if (peek() != static_cast<unsigned char>(c)) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  uint32_t read_hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= c - '0';
      else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
      else fail("bad hex digit in \\u escape");
    }
    return v;
  }
  std::string read_string() {
    expect('"');
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return out;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          uint32_t cp = read_hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a surrogate pair
            if (pos_ + 2 > s_.size() || s_[pos_] != '\\' || s_[pos_ + 1] != 'u') fail("lone high surrogate");
            pos_ += 2;
            uint32_t lo = read_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("lone low surrogate");
          }
          append_utf8(cp, &out);
          break;
        }
        default: fail(std::string("unknown escape \\") + e);
      }
    }
  }
  int read_int() {
    size_t start = pos_;
    bool negative = peek() == '-';
    if (negative) ++pos_;
    int64_t v = 0;
    int digits = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      v = v * 10 + (s_[pos_++] - '0');
      if (++digits > 10) break;
    }
    if (digits == 0 || digits > 10 || v > INT32_MAX) {
      pos_ = start;
      fail("expected an integer token id");
    }
    return static_cast<int>(negative ? -v : v);
  }

  std::string_view s_;
  const std::string& path_;
  size_t pos_ = 0;
};

struct Merge {
  int rank;
  int merged;  // id of the token the pair becomes
};

// The heap BPE's linked list of symbols and its candidate merges.
struct HeapSymbol {
  int id, prev, next;
};
struct HeapCandidate {
  int rank, pos, left, right;
  bool operator>(const HeapCandidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

inline uint64_t pair_key(int left, int right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

std::vector<uint32_t> gpt2_byte_to_unicode() {
  // Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls,
  // space, DEL, NBSP, soft hyphen...) take U+0100 onwards in byte order.
  std::vector<uint32_t> table(256);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    table[b] = printable ? b : next++;
  }
  return table;
}

std::vector<std::pair<std::string, int>> parse_encoder_json(std::string_view json, const std::string& path) {
  return JsonVocabReader(json, path).read();
}

std::vector<std::pair<std::string, std::string>> parse_bpe_merges(std::string_view text, const std::string& path) {
  std::vector<std::pair<std::string, std::string>> merges;
  size_t pos = 0;
  int line_no = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (line_no == 1 && line.substr(0, 8) == "#version") continue;
    if (line.empty()) continue;
    size_t space = line.find(' ');
    LATTICE_CHECK(space != std::string_view::npos && space > 0 && space + 1 < line.size() &&
                      line.find(' ', space + 1) == std::string_view::npos,
                  path << " line " << line_no << ": expected two tokens separated by one space, got '" << line << "'");
    merges.emplace_back(std::string(line.substr(0, space)), std::string(line.substr(space + 1)));
  }
  return merges;
}

struct Tokenizer::Impl {
  std::vector<std::string> token_bytes;  // id -> raw bytes
  int eot_id = -1;
  int byte_token[256];                   // byte -> id of its one-byte token
  std::unordered_map<uint64_t, Merge> merges;
  bool heap_merge_valid = true;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int>, StringHash, std::equal_to<>> cache;
  static constexpr size_t kMaxCacheEntries = 1 << 20;

  const Merge* find_merge(int left, int right) const {
    auto it = merges.find(pair_key(left, right));
    return it == merges.end() ? nullptr : &it->second;
  }

  // BPE of one piece with a min-heap of (rank, position) over a linked list of
  // symbols: O(n log n). Equal pairs are merged leftmost first, which is what
  // the reference's left-to-right sweep does.
  void bpe_heap(std::string_view piece, std::vector<int>* out) const {
    const int n = static_cast<int>(piece.size());
    // Scratch kept per thread: no allocation once warm.
    thread_local std::vector<HeapSymbol> symbols;
    thread_local std::vector<HeapCandidate> heap;
    symbols.resize(n);
    heap.clear();
    for (int i = 0; i < n; ++i)
      symbols[i] = {byte_token[static_cast<unsigned char>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1};
    auto push = [&](int pos) {
      int next = symbols[pos].next;
      if (next < 0) return;
      if (const Merge* m = find_merge(symbols[pos].id, symbols[next].id)) {
        heap.push_back({m->rank, pos, symbols[pos].id, symbols[next].id});
        std::push_heap(heap.begin(), heap.end(), std::greater<HeapCandidate>());
      }
    };
    for (int i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<HeapCandidate>());
      HeapCandidate c = heap.back();
      heap.pop_back();
      HeapSymbol& left = symbols[c.pos];
      // Stale if either symbol changed since the candidate was pushed (a token
      // id only ever grows into a longer token, so equal ids mean unchanged).
      if (left.id != c.left || left.next < 0 || symbols[left.next].id != c.right) continue;
      HeapSymbol& right = symbols[left.next];
      left.id = find_merge(c.left, c.right)->merged;
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].prev = c.pos;
      right.id = -1;
      if (left.prev >= 0) push(left.prev);
      push(c.pos);
    }
    for (int i = 0; i >= 0 && i < n; i = symbols[i].next) out->push_back(symbols[i].id);
  }

  // encoder.py's algorithm, on ids instead of strings.
  std::vector<int> bpe_reference(std::string_view piece) const {
    std::vector<int> word;
    for (unsigned char b : piece) word.push_back(byte_token[b]);
    while (word.size() > 1) {
      const Merge* best = nullptr;
      int best_left = 0, best_right = 0;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        const Merge* m = find_merge(word[i], word[i + 1]);
        if (m && (!best || m->rank < best->rank)) best = m, best_left = word[i], best_right = word[i + 1];
      }
      if (!best) break;
      std::vector<int> merged;
      for (size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == best_left && word[i + 1] == best_right) {
          merged.push_back(best->merged);
          i += 2;
        } else {
          merged.push_back(word[i++]);
        }
      }
      word.swap(merged);
    }
    return word;
  }

  void encode_piece(std::string_view piece, std::vector<int>* out) const {
    if (piece.size() == 1) {
      out->push_back(byte_token[static_cast<unsigned char>(piece[0])]);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(cache_mutex);
      auto it = cache.find(piece);
      if (it != cache.end()) {
        out->insert(out->end(), it->second.begin(), it->second.end());
        return;
      }
    }
    size_t begin = out->size();
    if (heap_merge_valid) {
      bpe_heap(piece, out);
    } else {
      std::vector<int> ids = bpe_reference(piece);
      out->insert(out->end(), ids.begin(), ids.end());
    }
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (cache.size() >= kMaxCacheEntries) cache.clear();
    cache.emplace(std::string(piece), std::vector<int>(out->begin() + begin, out->end()));
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& dir) {
  const std::string encoder_path = (std::filesystem::path(dir) / "encoder.json").string();
  const std::string merges_path = (std::filesystem::path(dir) / "vocab.bpe").string();
  auto entries = parse_encoder_json(read_vocab_file(encoder_path), encoder_path);
  auto merge_list = parse_bpe_merges(read_vocab_file(merges_path), merges_path);

  // Inverse of the byte -> unicode table; every other character is foreign.
  std::vector<uint32_t> byte_to_unicode = gpt2_byte_to_unicode();
  std::vector<int> unicode_to_byte(512, -1);
  for (int b = 0; b < 256; ++b) unicode_to_byte[byte_to_unicode[b]] = b;
  auto to_bytes = [&](const std::string& token, const std::string& path) {
    std::string bytes;
    const auto* s = reinterpret_cast<const unsigned char*>(token.data());
    for (size_t i = 0; i < token.size();) {
      int len;
      uint32_t cp = unicode::decode_utf8(s + i, token.size() - i, &len);
      LATTICE_CHECK(cp < unicode_to_byte.size() && unicode_to_byte[cp] >= 0,
                    path << ": token '" << token << "' has a character outside GPT-2's byte alphabet");
      bytes.push_back(static_cast<char>(unicode_to_byte[cp]));
      i += len;
    }
    return bytes;
  };

  auto impl = std::make_unique<Impl>();
  const int vocab = static_cast<int>(entries.size());
  LATTICE_CHECK(vocab >= 256, encoder_path << ": " << vocab << " tokens; a byte-level vocabulary needs at least 256");
  impl->token_bytes.resize(vocab);
  std::vector<bool> seen(vocab, false);
  std::unordered_map<std::string, int> bytes_to_id;
  bytes_to_id.reserve(vocab * 2);
  for (auto& [token, id] : entries) {
    LATTICE_CHECK(id >= 0 && id < vocab && !seen[id],
                  encoder_path << ": token '" << token << "' has id " << id
                               << "; ids must be distinct and in [0, " << vocab << ")");
    seen[id] = true;
    std::string bytes = to_bytes(token, encoder_path);
    LATTICE_CHECK(bytes_to_id.emplace(bytes, id).second, encoder_path << ": token '" << token << "' appears twice");
    impl->token_bytes[id] = std::move(bytes);
    if (token == "<|endoftext|>") impl->eot_id = id;
  }
  LATTICE_CHECK(impl->eot_id >= 0, encoder_path << ": no <|endoftext|> token");
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id.find(std::string(1, static_cast<char>(b)));
    LATTICE_CHECK(it != bytes_to_id.end(), encoder_path << ": no token for byte " << b);
    impl->byte_token[b] = it->second;
  }

  // Merges by rank. A repeated pair keeps its last rank, as Python's
  // dict(zip(merges, range(n))) in encoder.py does.
  impl->merges.reserve(merge_list.size() * 2);
  std::vector<int> last_made_at(vocab, -1);  // highest rank of a merge producing the token
  std::vector<std::array<int, 3>> triples;   // left, right, merged by rank
  triples.reserve(merge_list.size());
  for (size_t rank = 0; rank < merge_list.size(); ++rank) {
    const auto& [left, right] = merge_list[rank];
    std::string l = to_bytes(left, merges_path), r = to_bytes(right, merges_path);
    auto find = [&](const std::string& bytes, const std::string& shown) {
      auto it = bytes_to_id.find(bytes);
      LATTICE_CHECK(it != bytes_to_id.end(), merges_path << ": merge " << rank << " ('" << left << "' '" << right
                                                         << "') uses or makes '" << shown
                                                         << "', which is not in encoder.json");
      return it->second;
    };
    int a = find(l, left), b = find(r, right), m = find(l + r, left + right);
    impl->merges[pair_key(a, b)] = {static_cast<int>(rank), m};
    triples.push_back({a, b, m});
    last_made_at[m] = static_cast<int>(rank);
  }
  // The heap algorithm equals the reference when every merge's inputs were
  // made by earlier merges (true of GPT-2's file; checked, not assumed).
  for (size_t rank = 0; rank < triples.size(); ++rank) {
    const auto& t = triples[rank];
    if (impl->merges[pair_key(t[0], t[1])].rank != static_cast<int>(rank)) continue;  // superseded duplicate
    if (last_made_at[t[0]] >= static_cast<int>(rank) || last_made_at[t[1]] >= static_cast<int>(rank))
      impl->heap_merge_valid = false;
  }
  return Tokenizer(std::move(impl));
}

std::vector<int> Tokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  ids.reserve(text.size() / 3 + 16);
  encode_append(text, &ids);
  return ids;
}

void Tokenizer::encode_append(std::string_view text, std::vector<int>* out) const {
  PreTokenizer it(text);
  std::string_view piece;
  while (it.next(&piece)) impl_->encode_piece(piece, out);
}

std::vector<int> Tokenizer::encode_piece_reference(std::string_view piece) const {
  return impl_->bpe_reference(piece);
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string out;
  for (int id : ids) {
    LATTICE_CHECK(id >= 0 && id < vocab_size(), "token id " << id << " is outside the vocabulary [0, " << vocab_size() << ")");
    out += impl_->token_bytes[id];
  }
  return out;
}

std::string Tokenizer::decode_token(int id) const {
  LATTICE_CHECK(id >= 0 && id < vocab_size(), "token id " << id << " is outside the vocabulary [0, " << vocab_size() << ")");
  return impl_->token_bytes[id];
}

bool Tokenizer::uses_heap_merge() const { return impl_->heap_merge_valid; }

int Tokenizer::eot() const { return impl_->eot_id; }
int Tokenizer::vocab_size() const { return static_cast<int>(impl_->token_bytes.size()); }

}  // namespace lattice::data
