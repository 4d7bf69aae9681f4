#include "lattice/io/json.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "lattice/core/error.h"

namespace lattice::io {

namespace {

const char* type_name(JsonValue::Type t) {
  switch (t) {
    case JsonValue::Type::Null: return "null";
    case JsonValue::Type::Bool: return "a boolean";
    case JsonValue::Type::Number: return "a number";
    case JsonValue::Type::String: return "a string";
    case JsonValue::Type::Array: return "an array";
    case JsonValue::Type::Object: return "an object";
  }
  return "?";
}

bool is_integer_literal(const std::string& text) {
  return text.find_first_of(".eE") == std::string::npos;
}

}  // namespace

// ---------------------------------------------------------------- value

JsonValue JsonValue::boolean(bool b) {
  JsonValue v;
  v.type_ = Type::Bool;
  v.bool_ = b;
  return v;
}

JsonValue JsonValue::number(double x) {
  JsonValue v;
  if (!std::isfinite(x)) return v;
  v.type_ = Type::Number;
  v.number_ = x;
  v.text_ = json_number(x);
  return v;
}

JsonValue JsonValue::integer(int64_t x) {
  JsonValue v;
  v.type_ = Type::Number;
  v.number_ = static_cast<double>(x);
  v.text_ = std::to_string(x);
  return v;
}

JsonValue JsonValue::unsigned_integer(uint64_t x) {
  JsonValue v;
  v.type_ = Type::Number;
  v.number_ = static_cast<double>(x);
  v.text_ = std::to_string(x);
  return v;
}

JsonValue JsonValue::string(std::string s) {
  JsonValue v;
  v.type_ = Type::String;
  v.text_ = std::move(s);
  return v;
}

JsonValue JsonValue::array() {
  JsonValue v;
  v.type_ = Type::Array;
  return v;
}

JsonValue JsonValue::object() {
  JsonValue v;
  v.type_ = Type::Object;
  return v;
}

bool JsonValue::as_bool() const {
  LATTICE_CHECK(type_ == Type::Bool, "expected a JSON boolean, got " << type_name(type_));
  return bool_;
}

double JsonValue::as_double() const {
  LATTICE_CHECK(type_ == Type::Number, "expected a JSON number, got " << type_name(type_));
  return number_;
}

const std::string& JsonValue::as_string() const {
  LATTICE_CHECK(type_ == Type::String, "expected a JSON string, got " << type_name(type_));
  return text_;
}

const std::vector<JsonValue>& JsonValue::as_array() const {
  LATTICE_CHECK(type_ == Type::Array, "expected a JSON array, got " << type_name(type_));
  return array_;
}

const std::vector<JsonValue::Member>& JsonValue::as_object() const {
  LATTICE_CHECK(type_ == Type::Object, "expected a JSON object, got " << type_name(type_));
  return object_;
}

const std::string& JsonValue::number_text() const {
  LATTICE_CHECK(type_ == Type::Number, "expected a JSON number, got " << type_name(type_));
  return text_;
}

bool JsonValue::get_u64(uint64_t* out) const {
  if (type_ != Type::Number || !is_integer_literal(text_) || text_[0] == '-') return false;
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(text_.data(), text_.data() + text_.size(), v);
  if (ec != std::errc() || end != text_.data() + text_.size()) return false;
  *out = v;
  return true;
}

bool JsonValue::get_i64(int64_t* out) const {
  if (type_ != Type::Number || !is_integer_literal(text_)) return false;
  int64_t v = 0;
  auto [end, ec] = std::from_chars(text_.data(), text_.data() + text_.size(), v);
  if (ec != std::errc() || end != text_.data() + text_.size()) return false;
  *out = v;
  return true;
}

const JsonValue* JsonValue::find(std::string_view key) const {
  if (type_ != Type::Object) return nullptr;
  for (const Member& m : object_)
    if (m.first == key) return &m.second;
  return nullptr;
}

const JsonValue& JsonValue::at(std::string_view key) const {
  LATTICE_CHECK(type_ == Type::Object, "expected a JSON object, got " << type_name(type_));
  const JsonValue* v = find(key);
  LATTICE_CHECK(v != nullptr, "missing key '" << key << "'");
  return *v;
}

JsonValue& JsonValue::set(std::string key, JsonValue value) {
  LATTICE_CHECK(type_ == Type::Object, "JsonValue::set on " << type_name(type_));
  for (Member& m : object_) {
    if (m.first == key) {
      m.second = std::move(value);
      return *this;
    }
  }
  object_.emplace_back(std::move(key), std::move(value));
  return *this;
}

JsonValue& JsonValue::push_back(JsonValue value) {
  LATTICE_CHECK(type_ == Type::Array, "JsonValue::push_back on " << type_name(type_));
  array_.push_back(std::move(value));
  return *this;
}

size_t JsonValue::size() const {
  if (type_ == Type::Array) return array_.size();
  if (type_ == Type::Object) return object_.size();
  return 0;
}

bool JsonValue::operator==(const JsonValue& other) const {
  if (type_ != other.type_) return false;
  switch (type_) {
    case Type::Null: return true;
    case Type::Bool: return bool_ == other.bool_;
    case Type::Number:
      if (is_integer_literal(text_) && is_integer_literal(other.text_)) return text_ == other.text_;
      return number_ == other.number_;
    case Type::String: return text_ == other.text_;
    case Type::Array: return array_ == other.array_;
    case Type::Object: return object_ == other.object_;
  }
  return false;
}

// ---------------------------------------------------------------- parser

namespace {

class Parser {
 public:
  Parser(std::string_view text, const std::string& source, const JsonParseOptions& options)
      : s_(text), source_(source), options_(options) {}

  JsonValue parse_document() {
    skip_ws();
    JsonValue v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { fail_at(pos_, what); }

  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    size_t line = 1, column = 1;
    for (size_t i = 0; i < at && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    LATTICE_FAIL(source_ << ": invalid JSON at line " << line << " column " << column << ": " << what);
  }

  std::string describe_here() const {
    if (pos_ >= s_.size()) return "end of input";
    unsigned char c = static_cast<unsigned char>(s_[pos_]);
    if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
    char buf[16];
    std::snprintf(buf, sizeof buf, "byte 0x%02x", c);
    return buf;
  }

  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }

  bool consume_literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return true;
    }
    return false;
  }

  JsonValue parse_value(int depth) {
    if (pos_ >= s_.size()) fail("expected a value, got end of input");
    char c = s_[pos_];
    switch (c) {
      case '{': return parse_object(depth + 1);
      case '[': return parse_array(depth + 1);
      case '"': return JsonValue::string(parse_string());
      case 't':
        if (consume_literal("true")) return JsonValue::boolean(true);
        break;
      case 'f':
        if (consume_literal("false")) return JsonValue::boolean(false);
        break;
      case 'n':
        if (consume_literal("null")) return JsonValue::null();
        break;
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
        break;
    }
    fail("expected a value, got " + describe_here());
  }

  void check_depth(int depth) {
    if (depth > options_.max_depth)
      fail("nesting deeper than " + std::to_string(options_.max_depth) + " levels");
  }

  JsonValue parse_object(int depth) {
    check_depth(depth);
    ++pos_;  // '{'
    JsonValue obj = JsonValue::object();
    std::vector<JsonValue::Member> members;
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return obj;
    }
    for (;;) {
      skip_ws();
      if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected a string key, got " + describe_here());
      size_t key_pos = pos_;
      std::string key = parse_string();
      skip_ws();
      if (pos_ >= s_.size() || s_[pos_] != ':') fail("expected ':' after object key, got " + describe_here());
      ++pos_;
      skip_ws();
      JsonValue value = parse_value(depth);
      members.emplace_back(std::move(key), std::move(value));
      member_positions_.push_back(key_pos);
      skip_ws();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == '}') {
        ++pos_;
        break;
      }
      fail("expected ',' or '}' in object, got " + describe_here());
    }
    std::vector<size_t> positions(member_positions_.end() - members.size(), member_positions_.end());
    member_positions_.resize(member_positions_.size() - members.size());
    if (options_.reject_duplicate_keys && members.size() > 1) {
      std::vector<size_t> order(members.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(),
                       [&](size_t a, size_t b) { return members[a].first < members[b].first; });
      for (size_t i = 1; i < order.size(); ++i)
        if (members[order[i]].first == members[order[i - 1]].first)
          fail_at(positions[order[i]], "duplicate key " + json_quote(members[order[i]].first));
    }
    for (auto& m : members) obj.append_member(std::move(m.first), std::move(m.second));
    return obj;
  }

  JsonValue parse_array(int depth) {
    check_depth(depth);
    ++pos_;  // '['
    JsonValue arr = JsonValue::array();
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return arr;
    }
    for (;;) {
      skip_ws();
      arr.push_back(parse_value(depth));
      skip_ws();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == ']') {
        ++pos_;
        break;
      }
      fail("expected ',' or ']' in array, got " + describe_here());
    }
    return arr;
  }

  JsonValue parse_number() {
    size_t start = pos_;
    auto digit = [&](size_t i) { return i < s_.size() && s_[i] >= '0' && s_[i] <= '9'; };
    if (s_[pos_] == '-') ++pos_;
    if (!digit(pos_)) fail("expected a digit in number, got " + describe_here());
    if (s_[pos_] == '0') {
      ++pos_;
      if (digit(pos_)) fail("leading zeros are not allowed in numbers");
    } else {
      while (digit(pos_)) ++pos_;
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!digit(pos_)) fail("expected a digit after '.', got " + describe_here());
      while (digit(pos_)) ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!digit(pos_)) fail("expected a digit in exponent, got " + describe_here());
      while (digit(pos_)) ++pos_;
    }
    std::string_view literal = s_.substr(start, pos_ - start);
    double value = 0.0;
    auto [end, ec] = std::from_chars(literal.data(), literal.data() + literal.size(), value);
    if (ec == std::errc::result_out_of_range) {
      // Overflow is refused; underflow (1e-400) reads as 0 like every JSON reader.
      bool exp_negative = literal.find("e-") != std::string_view::npos ||
                          literal.find("E-") != std::string_view::npos;
      if (!exp_negative) fail_at(start, "number " + std::string(literal) + " is out of range");
      value = 0.0;
    } else if (ec != std::errc() || end != literal.data() + literal.size()) {
      fail_at(start, "malformed number " + std::string(literal));
    }
    return JsonValue::number_with_text(value, std::string(literal));
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  uint32_t parse_hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_ + i];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
      else fail("invalid hex digit in \\u escape");
    }
    pos_ += 4;
    return v;
  }

  // Validates one UTF-8 sequence starting at pos_ (first byte >= 0x80) and copies it.
  void copy_utf8_sequence(std::string& out) {
    auto byte = [&](size_t i) -> uint32_t { return static_cast<unsigned char>(s_[i]); };
    uint32_t b0 = byte(pos_);
    size_t len;
    uint32_t cp;
    if (b0 >= 0xC2 && b0 <= 0xDF) { len = 2; cp = b0 & 0x1F; }
    else if (b0 >= 0xE0 && b0 <= 0xEF) { len = 3; cp = b0 & 0x0F; }
    else if (b0 >= 0xF0 && b0 <= 0xF4) { len = 4; cp = b0 & 0x07; }
    else fail("invalid UTF-8 in string");
    if (pos_ + len > s_.size()) fail("truncated UTF-8 sequence in string");
    for (size_t i = 1; i < len; ++i) {
      uint32_t b = byte(pos_ + i);
      if ((b & 0xC0) != 0x80) fail("invalid UTF-8 in string");
      cp = (cp << 6) | (b & 0x3F);
    }
    // Overlong forms, UTF-16 surrogates and code points past U+10FFFF are not UTF-8.
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      fail("invalid UTF-8 in string");
    out.append(s_.data() + pos_, len);
    pos_ += len;
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) fail("control character in string (must be escaped)");
      if (c >= 0x80) {
        copy_utf8_sequence(out);
        continue;
      }
      if (c != '\\') {
        out += static_cast<char>(c);
        ++pos_;
        continue;
      }
      ++pos_;
      if (pos_ >= s_.size()) fail("unterminated string");
      char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("lone low surrogate in \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (s_.substr(pos_, 2) != "\\u") fail("high surrogate not followed by a low surrogate");
            pos_ += 2;
            uint32_t lo = parse_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("high surrogate not followed by a low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          --pos_;
          fail("invalid escape '\\" + std::string(1, e) + "' in string");
      }
    }
  }

  std::string_view s_;
  const std::string& source_;
  const JsonParseOptions& options_;
  size_t pos_ = 0;
  std::vector<size_t> member_positions_;
};

void write_value(std::string& out, const JsonValue& v, int indent, int level) {
  auto newline = [&](int lvl) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * lvl), ' ');
  };
  switch (v.type()) {
    case JsonValue::Type::Null: out += "null"; break;
    case JsonValue::Type::Bool: out += v.as_bool() ? "true" : "false"; break;
    case JsonValue::Type::Number: out += v.number_text(); break;
    case JsonValue::Type::String: out += json_quote(v.as_string()); break;
    case JsonValue::Type::Array: {
      const auto& a = v.as_array();
      out += '[';
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        write_value(out, a[i], indent, level + 1);
      }
      if (!a.empty()) newline(level);
      out += ']';
      break;
    }
    case JsonValue::Type::Object: {
      const auto& o = v.as_object();
      out += '{';
      for (size_t i = 0; i < o.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        out += json_quote(o[i].first);
        out += indent < 0 ? ":" : ": ";
        write_value(out, o[i].second, indent, level + 1);
      }
      if (!o.empty()) newline(level);
      out += '}';
      break;
    }
  }
}

}  // namespace

JsonValue JsonValue::number_with_text(double x, std::string text) {
  JsonValue v;
  v.type_ = Type::Number;
  v.number_ = x;
  v.text_ = std::move(text);
  return v;
}

JsonValue& JsonValue::append_member(std::string key, JsonValue value) {
  LATTICE_CHECK(type_ == Type::Object, "JsonValue::append_member on " << type_name(type_));
  object_.emplace_back(std::move(key), std::move(value));
  return *this;
}

JsonValue parse_json(std::string_view text, const std::string& source_name, const JsonParseOptions& options) {
  Parser parser(text, source_name, options);
  return parser.parse_document();
}

std::string to_json(const JsonValue& value, int indent) {
  std::string out;
  write_value(out, value, indent, 0);
  return out;
}

std::string json_quote(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  for (char ch : text) {
    unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
  return out;
}

std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  // Shortest round-trip text; plain decimals ("0.0006", not "6e-04") for
  // magnitudes people read that way, exponents outside that range.
  char buf[400];
  double mag = std::fabs(x);
  bool fixed = mag == 0 || (mag >= 1e-5 && mag < 1e15);
  auto [end, ec] = fixed ? std::to_chars(buf, buf + sizeof buf, x, std::chars_format::fixed)
                         : std::to_chars(buf, buf + sizeof buf, x);
  (void)ec;
  return std::string(buf, end);
}

}  // namespace lattice::io
