// A small strict JSON (RFC 8259) value tree, parser and writer.
//
// Used for the safetensors header (untrusted input), checkpoint meta.json and
// metrics lines. The parser accepts exactly RFC 8259: no comments, no trailing
// commas, no NaN/Infinity, no leading zeros, no control characters or invalid
// UTF-8 inside strings, no lone surrogates. Nesting depth is bounded so a
// hostile input cannot overflow the stack. Every failure is a lattice::Error
// naming the source, line and column.
//
// Numbers keep their literal text next to the double value, so integers that
// do not fit a double (file offsets up to 2^64 - 1) are read back exactly with
// get_u64 / get_i64, and written back unchanged.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lattice::io {

class JsonValue {
 public:
  enum class Type : uint8_t { Null, Bool, Number, String, Array, Object };
  using Member = std::pair<std::string, JsonValue>;

  JsonValue() = default;  // null
  static JsonValue null() { return JsonValue(); }
  static JsonValue boolean(bool b);
  // A non-finite double becomes null (JSON has no NaN or infinity).
  static JsonValue number(double x);
  static JsonValue integer(int64_t x);
  static JsonValue unsigned_integer(uint64_t x);
  static JsonValue string(std::string s);
  static JsonValue array();
  static JsonValue object();

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::Null; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_number() const { return type_ == Type::Number; }
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }

  // Accessors throw lattice::Error when the type does not match.
  bool as_bool() const;
  double as_double() const;
  const std::string& as_string() const;
  const std::vector<JsonValue>& as_array() const;
  const std::vector<Member>& as_object() const;  // members in document / insertion order

  // Exact integers: true (and *out set) when the number is an integer literal
  // (no fraction, no exponent) that fits the type; false otherwise.
  bool get_u64(uint64_t* out) const;
  bool get_i64(int64_t* out) const;
  // The number as written ("1e-3", "18446744073709551615").
  const std::string& number_text() const;

  // Object access. find returns nullptr when absent (or when not an object).
  const JsonValue* find(std::string_view key) const;
  // Throws lattice::Error "missing key 'k'" when absent.
  const JsonValue& at(std::string_view key) const;
  // Sets key (replacing an existing member, keeping its position). Returns *this.
  JsonValue& set(std::string key, JsonValue value);
  // Appends a member without looking for an existing key (parsers that keep
  // duplicates use it). Returns *this.
  JsonValue& append_member(std::string key, JsonValue value);
  // Array append. Returns *this.
  JsonValue& push_back(JsonValue value);
  // A number with its literal text as read (the text must be a valid JSON number).
  static JsonValue number_with_text(double x, std::string text);
  size_t size() const;  // array elements or object members; 0 otherwise

  bool operator==(const JsonValue& other) const;

 private:
  Type type_ = Type::Null;
  bool bool_ = false;
  double number_ = 0.0;
  std::string text_;  // string value, or the number's literal text
  std::vector<JsonValue> array_;
  std::vector<Member> object_;
};

struct JsonParseOptions {
  // Objects with a repeated key are an error ("duplicate key 'x'") unless
  // this is false, in which case every member is kept in order.
  bool reject_duplicate_keys = true;
  int max_depth = 64;
};

// Parses exactly one JSON value (surrounded by optional whitespace).
// source_name appears in every error: "<source_name>: invalid JSON at line 1 column 7: ...".
JsonValue parse_json(std::string_view text, const std::string& source_name,
                     const JsonParseOptions& options = {});

// Compact form when indent < 0; otherwise pretty-printed with `indent` spaces.
std::string to_json(const JsonValue& value, int indent = -1);

// "text" with quotes, escaping ", \, and control characters; other bytes pass through.
std::string json_quote(std::string_view text);
// Shortest text that reads back as the same double; "null" when not finite.
std::string json_number(double x);

}  // namespace lattice::io
