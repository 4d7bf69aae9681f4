#include "lattice/io/json.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "test_util.h"

namespace lattice::io {
namespace {

TEST(Json, ParsesAllValueKinds) {
  JsonValue v = parse_json(R"( {"a": [1, -2.5e3, true, false, null], "s": "x\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00", "o": {}} )",
                           "test");
  ASSERT_TRUE(v.is_object());
  const auto& a = v.at("a").as_array();
  ASSERT_EQ(a.size(), 5u);
  EXPECT_EQ(a[0].as_double(), 1.0);
  EXPECT_EQ(a[1].as_double(), -2500.0);
  EXPECT_TRUE(a[2].as_bool());
  EXPECT_FALSE(a[3].as_bool());
  EXPECT_TRUE(a[4].is_null());
  EXPECT_EQ(v.at("s").as_string(), "x\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(v.at("o").is_object());
  EXPECT_EQ(v.at("o").size(), 0u);
  EXPECT_EQ(v.find("missing"), nullptr);
}

TEST(Json, KeepsMemberOrder) {
  JsonValue v = parse_json(R"({"z": 1, "a": 2, "m": 3})", "test");
  const auto& members = v.as_object();
  ASSERT_EQ(members.size(), 3u);
  EXPECT_EQ(members[0].first, "z");
  EXPECT_EQ(members[1].first, "a");
  EXPECT_EQ(members[2].first, "m");
}

TEST(Json, ExactIntegers) {
  JsonValue v = parse_json("[18446744073709551615, 9223372036854775807, -9223372036854775808, 18446744073709551616, 1.0, 1e3, -1]",
                           "test");
  const auto& a = v.as_array();
  uint64_t u = 0;
  int64_t i = 0;
  EXPECT_TRUE(a[0].get_u64(&u));
  EXPECT_EQ(u, 18446744073709551615ull);
  EXPECT_FALSE(a[0].get_i64(&i));
  EXPECT_TRUE(a[1].get_i64(&i));
  EXPECT_EQ(i, 9223372036854775807ll);
  EXPECT_TRUE(a[2].get_i64(&i));
  EXPECT_EQ(i, std::numeric_limits<int64_t>::min());
  EXPECT_FALSE(a[3].get_u64(&u));  // does not fit
  EXPECT_FALSE(a[4].get_u64(&u));  // not an integer literal
  EXPECT_FALSE(a[5].get_u64(&u));
  EXPECT_FALSE(a[6].get_u64(&u));  // negative
  EXPECT_TRUE(a[6].get_i64(&i));
  EXPECT_EQ(i, -1);
  // Written back unchanged.
  EXPECT_EQ(to_json(v), "[18446744073709551615,9223372036854775807,-9223372036854775808,18446744073709551616,1.0,1e3,-1]");
}

TEST(Json, RejectsWhatRfc8259Rejects) {
  const char* bad[] = {
      "",           "   ",         "{",          "[1,]",        "{\"a\":1,}",  "{'a':1}",     "[01]",
      "[1.]",       "[.5]",        "[1e]",       "[-]",         "[+1]",        "[NaN]",       "[Infinity]",
      "[1e999]",    "tru",         "nul",        "[\"a\\x\"]",  "[\"\\u12\"]", "[\"\\ud800\"]", "[\"\\udc00\"]",
      "\"\x01\"",   "\"\xff\"",    "\"\xc0\xaf\"", "\"\xed\xa0\x80\"", "\"\xf4\x90\x80\x80\"", "\"abc",
      "[1] [2]",    "{\"a\" 1}",   "{1:2}",      "/* c */ 1",   "[1,,2]",      "{\"a\":1 \"b\":2}",
  };
  for (const char* text : bad) {
    EXPECT_THROW(parse_json(text, "test"), lattice::Error) << "accepted: " << text;
  }
}

TEST(Json, ErrorsNameSourceLineAndColumn) {
  EXPECT_ERROR_CONTAINS(parse_json("{\n  \"a\": 1,\n  \"b\": tru\n}", "meta.json"),
                        "meta.json: invalid JSON at line 3 column 8: expected a value");
  EXPECT_ERROR_CONTAINS(parse_json("[1, 2", "x"), "expected ',' or ']' in array, got end of input");
  EXPECT_ERROR_CONTAINS(parse_json("{\"k\": 1, \"k\": 2}", "x"), "line 1 column 10: duplicate key \"k\"");
  EXPECT_ERROR_CONTAINS(parse_json("[01]", "x"), "leading zeros");
}

TEST(Json, DuplicateKeysCanBeKept) {
  JsonParseOptions keep;
  keep.reject_duplicate_keys = false;
  JsonValue v = parse_json(R"({"k": 1, "k": 2})", "x", keep);
  EXPECT_EQ(v.size(), 2u);
}

TEST(Json, DepthIsBounded) {
  std::string deep(100000, '[');
  EXPECT_ERROR_CONTAINS(parse_json(deep, "x"), "nesting deeper than 64 levels");
  std::string ok = std::string(64, '[') + std::string(64, ']');
  EXPECT_NO_THROW(parse_json(ok, "x"));
}

TEST(Json, WriterRoundTrips) {
  JsonValue v = JsonValue::object();
  v.set("step", JsonValue::integer(120));
  v.set("loss", JsonValue::number(2.718281828459045));
  v.set("nan", JsonValue::number(std::nan("")));
  v.set("big", JsonValue::unsigned_integer(18446744073709551615ull));
  v.set("text", JsonValue::string("tab\there \"quoted\" \x01 \xc3\xa9"));
  JsonValue arr = JsonValue::array();
  arr.push_back(JsonValue::boolean(true)).push_back(JsonValue());
  v.set("arr", arr);
  v.set("step", JsonValue::integer(121));  // replaces in place
  EXPECT_EQ(v.as_object()[0].first, "step");
  EXPECT_TRUE(v.at("nan").is_null());
  for (int indent : {-1, 0, 2}) {
    JsonValue back = parse_json(to_json(v, indent), "roundtrip");
    EXPECT_EQ(back, v) << to_json(v, indent);
  }
  EXPECT_EQ(to_json(v.at("arr")), "[true,null]");
  EXPECT_EQ(json_quote("a\"b\\c\n\x1f"), "\"a\\\"b\\\\c\\n\\u001f\"");
  EXPECT_EQ(json_number(0.1), "0.1");
  EXPECT_EQ(json_number(12), "12");
  EXPECT_EQ(json_number(std::numeric_limits<double>::infinity()), "null");
}

TEST(Json, AccessorsCheckTypes) {
  JsonValue v = parse_json("[1]", "x");
  EXPECT_ERROR_CONTAINS(v.as_string(), "expected a JSON string, got an array");
  EXPECT_ERROR_CONTAINS(v.at("k"), "expected a JSON object");
  JsonValue o = parse_json("{}", "x");
  EXPECT_ERROR_CONTAINS(o.at("k"), "missing key 'k'");
}

}  // namespace
}  // namespace lattice::io
