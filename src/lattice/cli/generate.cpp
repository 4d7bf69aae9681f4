// lattice generate --checkpoint DIR --prompt TEXT [--max-new-tokens N]
//                  [--temperature T] [--top-k K] [--seed S]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "lattice/cli/args.h"
#include "lattice/cli/command.h"
#include "lattice/core/error.h"
#include "lattice/core/rng.h"
#include "lattice/core/threads.h"
#include "lattice/data/paths.h"
#include "lattice/data/tokenizer.h"
#include "lattice/io/safetensors.h"
#include "lattice/model/gpt.h"
#include "lattice/train/checkpointing.h"
#include "lattice/train/model_io.h"

namespace lattice::cli {

static const char* kGenerateHelp =
    "usage: lattice generate --checkpoint PATH --prompt TEXT [options]\n"
    "\n"
    "Samples text from a trained model. Keys and values are cached, so each new token\n"
    "costs one position's forward until the context reaches the model's seq_len; past\n"
    "it the model sees the most recent seq_len tokens, recomputed for every token.\n"
    "  --checkpoint PATH     a checkpoint directory (run dir with 'latest', or a step_N dir),\n"
    "                        a Hugging Face model directory (model.safetensors + config.json:\n"
    "                        GPT-2 or Llama), a .safetensors file with config.json beside it,\n"
    "                        or a bare .safetensors file with HF GPT-2 names (then --n-head)\n"
    "  --prompt TEXT         the text to continue (default: a new document)\n"
    "  --max-new-tokens N    tokens to sample (default 100)\n"
    "  --temperature T       softmax temperature, > 0 (default 1.0; 0 = greedy)\n"
    "  --top-k K             sample among the K most likely tokens (default 40; 0 = all)\n"
    "  --seed S              sampling seed (default 1337)\n"
    "  --n-head H            heads, for a bare .safetensors without that metadata\n"
    "  --threads N           threads (default: all cores)\n"
    "  --tokenizer DIR       folder with encoder.json and vocab.bpe (default .cache/gpt2)\n";

// Picks the next token from logits[0:V).
static int sample(const float* logits, int V, float temperature, int top_k, Rng& rng, std::vector<float>& probs,
                  std::vector<int>& order) {
  if (temperature <= 0.0f) return static_cast<int>(std::max_element(logits, logits + V) - logits);
  order.resize(V);
  for (int i = 0; i < V; i++) order[i] = i;
  int k = (top_k <= 0 || top_k > V) ? V : top_k;
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return logits[a] > logits[b]; });
  probs.resize(k);
  double sum = 0;
  const float top = logits[order[0]];
  for (int i = 0; i < k; i++) sum += probs[i] = std::exp((logits[order[i]] - top) / temperature);
  double u = rng.next_uniform() * sum;
  for (int i = 0; i < k; i++) {
    u -= probs[i];
    if (u <= 0) return order[i];
  }
  return order[k - 1];
}

static int run_generate(const std::vector<std::string>& args) {
  std::string checkpoint, prompt, tokenizer_dir = data::default_tokenizer_dir();
  long long max_new = 100, top_k = 40, seed = 1337, n_head = 0, threads = 0;
  double temperature = 1.0;
  bool have_prompt = false;
  for (size_t i = 1; i < args.size(); i++) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kGenerateHelp);
      return 0;
    } else if (a == "--checkpoint") {
      checkpoint = flag_value(args, i++);
    } else if (a == "--prompt") {
      prompt = flag_value(args, i++);
      have_prompt = true;
    } else if (a == "--max-new-tokens") {
      max_new = parse_int_flag(a, flag_value(args, i++), 1);
    } else if (a == "--temperature") {
      temperature = parse_float_flag(a, flag_value(args, i++));
      LATTICE_CHECK(temperature >= 0, "--temperature must be >= 0, got " << temperature);
    } else if (a == "--top-k") {
      top_k = parse_int_flag(a, flag_value(args, i++), 0);
    } else if (a == "--seed") {
      seed = parse_int_flag(a, flag_value(args, i++));
    } else if (a == "--n-head") {
      n_head = parse_int_flag(a, flag_value(args, i++));
    } else if (a == "--threads") {
      threads = parse_int_flag(a, flag_value(args, i++));
    } else if (a == "--tokenizer") {
      tokenizer_dir = flag_value(args, i++);
    } else {
      LATTICE_FAIL("lattice generate: unknown option '" << a << "' (see lattice generate --help)");
    }
  }
  LATTICE_CHECK(!checkpoint.empty(), "lattice generate needs --checkpoint PATH (see lattice generate --help)");
  set_num_threads(static_cast<int>(threads));
  data::Tokenizer tok = data::Tokenizer::load(tokenizer_dir);

  std::unique_ptr<model::GPT> gpt = train::load_model_for_inference(checkpoint, static_cast<int>(n_head));
  const model::ModelConfig& mc = gpt->config();
  LATTICE_CHECK(mc.vocab_size <= tok.vocab_size(), "the model's vocabulary (" << mc.vocab_size
                                                                              << ") is larger than the tokenizer's ("
                                                                              << tok.vocab_size() << ")");
  std::vector<int32_t> context;
  if (have_prompt && !prompt.empty()) {
    for (int id : tok.encode(prompt)) {
      LATTICE_CHECK(id < mc.vocab_size, "the prompt's token " << id << " ('" << tok.decode_token(id)
                                                              << "') is outside this model's vocabulary of "
                                                              << mc.vocab_size << " tokens");
      context.push_back(id);
    }
  } else {
    LATTICE_CHECK(tok.eot() < mc.vocab_size, "this model's vocabulary (" << mc.vocab_size
                                                                         << ") has no <|endoftext|>: give a --prompt");
    context.push_back(tok.eot());
  }
  std::printf("%s", have_prompt ? prompt.c_str() : "");
  std::fflush(stdout);
  Rng rng(static_cast<uint64_t>(seed), 0x6E4E);
  std::vector<float> probs;
  std::vector<int> order;
  for (long long n = 0; n < max_new; n++) {
    // The most recent seq_len tokens; one new position's work per token
    // through the key/value cache until the window starts to slide.
    const float* logits = gpt->next_logits(context.data(), static_cast<int64_t>(context.size()));
    int next = sample(logits, mc.vocab_size, static_cast<float>(temperature), static_cast<int>(top_k), rng, probs,
                      order);
    if (next == tok.eot()) break;
    context.push_back(next);
    std::string piece = tok.decode_token(next);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  }
  std::printf("\n");
  return 0;
}

LATTICE_REGISTER_COMMAND("generate", "sample text from a trained model", run_generate);

}  // namespace lattice::cli
