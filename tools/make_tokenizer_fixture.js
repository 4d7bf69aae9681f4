// Makes tests/data/fixtures/tokenizer_fixture.bin: GPT-2 token ids computed by
// an independent implementation, the JavaScript encoder of the npm package
// gpt-3-encoder@1.1.4 (a port of OpenAI's encoder.py, MIT; scripts/setup.sh
// unpacks it into .cache/npm/gpt-3-encoder). tests/data/tokenizer_test.cpp
// checks that lattice's C++ tokenizer gives the same ids.
//
//   node tools/make_tokenizer_fixture.js            (from the repository root)
//
// Cases: three slices of Moby-Dick (.cache/data/moby-dick.txt, ~100 KB each,
// stored by byte offset and length, not copied), a list of tricky strings
// (contractions, numbers, scripts, white-space runs, punctuation), and seeded
// random strings over an alphabet of such characters.
//
// The JS encoder's \s is JavaScript's (it adds U+FEFF and lacks U+0085, where
// GPT-2's Python `regex` uses Unicode White_Space), so neither character is
// used here; see docs/data.md.
//
// File layout (little-endian):
//   "LTKFIX01"  u32 case_count
//   per case:   u8 kind (0: text inline, 1: slice of moby-dick.txt)
//               u32 name_len, name bytes
//               kind 0: u32 text_len, text bytes (UTF-8)
//               kind 1: u32 byte_offset, u32 byte_length
//               u32 id_count, id_count x u16 ids
'use strict';
const fs = require('fs');
const path = require('path');

const root = path.resolve(__dirname, '..');
const encoderDir = path.join(root, '.cache/npm/gpt-3-encoder');
const corpusPath = path.join(root, '.cache/data/moby-dick.txt');
const outPath = path.join(root, 'tests/data/fixtures/tokenizer_fixture.bin');
if (!fs.existsSync(path.join(encoderDir, 'Encoder.js')) || !fs.existsSync(corpusPath)) {
  console.error('make_tokenizer_fixture: run scripts/setup.sh (or scripts/fetch_data.sh) first');
  process.exit(1);
}
const { encode, decode } = require(path.join(encoderDir, 'Encoder.js'));

const cases = [];
function addText(name, text) { cases.push({ kind: 0, name, text }); }

// Slices of the corpus, cut at newlines so each is valid UTF-8 on its own.
const corpus = fs.readFileSync(corpusPath);
function lineStart(offset) {
  while (offset > 0 && corpus[offset - 1] !== 0x0a) offset--;
  return offset;
}
for (const [name, from] of [['moby-dick start', 0], ['moby-dick middle', 550000], ['moby-dick end', 1100000]]) {
  const begin = lineStart(from);
  const end = Math.min(corpus.length, lineStart(begin + 100000));
  cases.push({ kind: 1, name, offset: begin, length: (end === corpus.length ? end : end) - begin });
}

const tricky = [
  '', ' the', 'Hello world', 'hello', ' ', '  ', '\n', '\n\n', 'a',
  "I'm you're they've we'll he'd she's it't",
  "'S 'T 'RE upper-case contractions are not split off",
  "don't can't won't shouldn't y'all rock'n'roll", "''s '''", "x's 's 'd 'll'm 've're",
  'curly ’s and ‘quoted’ “double”', 'em—dash and en–dash',
  'In 1851, 3.14159 and 1,000,000 and 007 and 2024-05-20',
  'fractions ½ ¾, superscripts x² y³, Arabic-Indic ٣٤٥, Roman Ⅻ, circled ①②',
  'naïve café Zürich façade Ærøskøbing', 'Ελληνικά κείμενα', 'Русский текст, ёлка',
  '日本語のテキストです。', '한국어 문장', 'עברית', 'العربية ١٢٣', 'हिन्दी पाठ', 'ไทย',
  'emoji 🙂👍🏽 and 🇫🇷 flags', 'combining e\u0301 and a\u0308', 'titlecase ǅ ǈ', 'ßẞ ﬁ ligature',
  'a  b', 'a   b', 'a    b', 'a \n b', 'a\n\nb', 'a\n \nb', 'trailing   ', '  leading', '\t\ttabs\tx',
  'nbsp\u00a0between', 'ideographic\u3000space', 'em\u2003space', 'line\u2028sep', 'para\u2029sep',
  '\r\n windows\r\nline endings\r\n', '\v vertical \f feed',
  '!!!???...', '--- === ***', '(parens) [brackets] {braces} <angles>', 'a.b,c;d:e', 'C++ #include <vector>',
  'text with <|endoftext|> in it', 'U.S.A. e-mail $100.00 50% @user #tag', 'abc123def 456ghi',
  'snake_case camelCase PascalCase kConstant', 'https://example.com/path?q=1&r=2#frag',
  'control\u0000\u0001\u001f chars \u007f del', 'soft\u00adhyphen',
  'a'.repeat(300), '='.repeat(200), ' '.repeat(50) + 'x', '\n'.repeat(20) + 'end', 'ab'.repeat(100),
  'Mississippi mississippi MISSISSIPPI', '    def f(x):\n        return x  # comment\n',
];
tricky.forEach((t, i) => addText(`tricky ${i}`, t));

// Seeded random strings (xorshift32) over characters the pattern treats differently.
const alphabet = [
  'a', 'b', 'e', 's', 't', 'r', 'v', 'l', 'm', 'd', 'S', 'T', 'Z', 'é', 'ß', 'Ж', 'λ', '中', 'ก',
  '0', '1', '9', '²', '½', '٣', 'Ⅻ',
  ' ', ' ', ' ', '  ', '\n', '\t', '\r', '\u00a0', '\u3000', '\u2028',
  "'", "'", '’', '.', ',', '!', '-', '_', '"', '(', ')', '#', '€', '—', '🙂', '\u0301',
];
let state = 20240520;
function rand(n) {
  state ^= state << 13; state >>>= 0;
  state ^= state >>> 17;
  state ^= state << 5; state >>>= 0;
  return state % n;
}
for (let i = 0; i < 300; i++) {
  const len = 1 + rand(40);
  let s = '';
  for (let j = 0; j < len; j++) s += alphabet[rand(alphabet.length)];
  addText(`random ${i}`, s);
}

// Encode with the JS reference and write the file.
const chunks = [Buffer.from('LTKFIX01', 'latin1')];
const u32 = v => { const b = Buffer.alloc(4); b.writeUInt32LE(v); return b; };
chunks.push(u32(cases.length));
let totalIds = 0, totalBytes = 0;
for (const c of cases) {
  const text = c.kind === 0 ? c.text : corpus.subarray(c.offset, c.offset + c.length).toString('utf8');
  const ids = encode(text);
  if (decode(ids) !== text) throw new Error(`JS round trip failed for ${c.name}`);
  const name = Buffer.from(c.name, 'utf8');
  chunks.push(Buffer.from([c.kind]), u32(name.length), name);
  if (c.kind === 0) {
    const t = Buffer.from(c.text, 'utf8');
    chunks.push(u32(t.length), t);
    totalBytes += t.length;
  } else {
    chunks.push(u32(c.offset), u32(c.length));
    totalBytes += c.length;
  }
  const idBuf = Buffer.alloc(2 * ids.length);
  ids.forEach((id, k) => idBuf.writeUInt16LE(id, 2 * k));
  chunks.push(u32(ids.length), idBuf);
  totalIds += ids.length;
}
fs.mkdirSync(path.dirname(outPath), { recursive: true });
fs.writeFileSync(outPath, Buffer.concat(chunks));
console.log(`make_tokenizer_fixture: ${cases.length} cases, ${totalBytes} bytes of text, ${totalIds} ids -> ` +
            `${path.relative(root, outPath)} (${fs.statSync(outPath).size} bytes)`);
