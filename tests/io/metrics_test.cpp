#include "lattice/io/metrics.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "lattice/io/plot.h"
#include "test_util.h"

namespace lattice::io {
namespace {

using testing::read_text;
using testing::TempDir;
using testing::write_text;

TEST(Metrics, WritesOneFlushedJsonObjectPerLine) {
  TempDir dir;
  std::string path = dir / "sub/metrics.jsonl";  // parent directory is created
  {
    MetricsWriter w(path, /*truncate=*/true);
    w.write({{"step", 1}, {"loss", 5.25}, {"lr", 6e-4}, {"grad_norm", std::nan("")},
             {"peak_mem_bytes", 1234567168}},
            {{"note", "warm \"up\""}});
    // Flushed: visible before the writer closes.
    EXPECT_EQ(read_text(path),
              "{\"step\":1,\"loss\":5.25,\"lr\":0.0006,\"grad_norm\":null,\"peak_mem_bytes\":1234567168,"
              "\"note\":\"warm \\\"up\\\"\"}\n");
    w.write({{"step", 2}, {"loss", std::numeric_limits<double>::infinity()}, {"val_loss", 4.5}});
  }
  {
    MetricsWriter w(path);  // appends
    JsonValue o = JsonValue::object();
    o.set("step", JsonValue::integer(3));
    o.set("loss", JsonValue::number(4.0));
    w.write(o);
  }
  MetricsColumns m = read_metrics_jsonl(path);
  EXPECT_EQ(m.rows, 3u);
  EXPECT_EQ(m.names, (std::vector<std::string>{"step", "loss", "lr", "grad_norm", "peak_mem_bytes", "note", "val_loss"}));
  EXPECT_EQ(m.column("step"), (std::vector<double>{1, 2, 3}));
  EXPECT_EQ(m.column("loss")[0], 5.25);
  EXPECT_TRUE(std::isnan(m.column("loss")[1]));  // inf was written as null
  EXPECT_EQ(m.column("loss")[2], 4.0);
  EXPECT_TRUE(std::isnan(m.column("val_loss")[0]));
  EXPECT_EQ(m.column("val_loss")[1], 4.5);
  EXPECT_TRUE(std::isnan(m.column("note")[0]));  // strings are not numbers
  EXPECT_ERROR_CONTAINS(m.column("mfu"), "metrics file '" + path + "' has no column 'mfu'");

  MetricsWriter fresh(path, true);
  EXPECT_EQ(read_text(path), "");
}

TEST(Metrics, ReaderSkipsATornLastLineOnly) {
  TempDir dir;
  write_text(dir / "m.jsonl", "{\"step\":1,\"loss\":3}\n\n{\"step\":2,\"lo");
  MetricsColumns m = read_metrics_jsonl(dir / "m.jsonl");
  EXPECT_EQ(m.rows, 1u);
  write_text(dir / "bad.jsonl", "{\"step\":1}\n{\"step\":\n{\"step\":3}\n");
  EXPECT_ERROR_CONTAINS(read_metrics_jsonl(dir / "bad.jsonl"), "metrics file '" + (dir / "bad.jsonl") + "' line 2");
  write_text(dir / "arr.jsonl", "[1]\n");
  EXPECT_ERROR_CONTAINS(read_metrics_jsonl(dir / "arr.jsonl"), "line 1 is not a JSON object");
  EXPECT_ERROR_CONTAINS(read_metrics_jsonl(dir / "none.jsonl"), "cannot read metrics file");
  EXPECT_ERROR_CONTAINS(MetricsWriter(dir / "m.jsonl/x"), "metrics file");
}

TEST(Plot, DrawsAxesTicksLegendAndLines) {
  PlotSeries loss{"train <loss>", {}, {}};
  for (int i = 0; i <= 100; ++i) {
    loss.xs.push_back(i);
    loss.ys.push_back(10.0 * std::exp(-i / 30.0) + 2);
  }
  PlotSeries val{"val", {0, 50, 100}, {11, 4, std::nan("")}};
  std::string svg = svg_plot("Loss & co", {loss, val}, "step", "loss");
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("Loss &amp; co"), std::string::npos);
  EXPECT_NE(svg.find("train &lt;loss&gt;"), std::string::npos);
  EXPECT_NE(svg.find("<polyline"), std::string::npos);
  EXPECT_NE(svg.find("<circle"), std::string::npos);  // sparse val series gets markers
  EXPECT_NE(svg.find(">100</text>"), std::string::npos);  // an x tick label
  EXPECT_NE(svg.find(">12</text>"), std::string::npos);   // a y tick label
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);

  // Degenerate inputs still give a valid frame.
  for (const std::vector<PlotSeries>& s :
       {std::vector<PlotSeries>{}, std::vector<PlotSeries>{{"flat", {1, 2}, {5, 5}}},
        std::vector<PlotSeries>{{"one", {3}, {0}}}, std::vector<PlotSeries>{{"missing", {1}, {std::nan("")}}},
        std::vector<PlotSeries>{{"huge", {0, 1}, {-1e308, 1e308}}},
        std::vector<PlotSeries>{{"tiny range", {1e17, 1e17 + 64}, {1, 2}}}}) {
    std::string out = svg_plot("t", s, "x", "y");
    EXPECT_NE(out.find("</svg>"), std::string::npos);
    EXPECT_EQ(out.find("nan"), std::string::npos) << out;
  }
  EXPECT_NE(svg_plot("t", {{"tps", {0, 1}, {120000, 250000}}}, "x", "y").find("k</text>"), std::string::npos);
  EXPECT_ERROR_CONTAINS(svg_plot("t", {{"bad", {1, 2}, {1}}}, "x", "y"), "plot series 'bad' has 2 x values and 1 y values");
}

TEST(Plot, PlotsAMetricsFile) {
  TempDir dir;
  {
    MetricsWriter w(dir / "m.jsonl", true);
    for (int step = 1; step <= 20; ++step) {
      std::vector<std::pair<std::string, double>> f = {{"step", step}, {"loss", 6.0 - 0.1 * step},
                                                       {"tokens_per_sec", 1000.0 + step}};
      if (step % 5 == 0) f.push_back({"val_loss", 6.1 - 0.1 * step});
      w.write(f);
    }
  }
  std::vector<std::string> written = plot_metrics(dir / "m.jsonl", dir / "run_");
  EXPECT_EQ(written, (std::vector<std::string>{dir / "run_loss.svg", dir / "run_throughput.svg"}));
  EXPECT_NE(read_text(dir / "run_loss.svg").find("val loss"), std::string::npos);
  EXPECT_NE(read_text(dir / "run_throughput.svg").find("tokens/s"), std::string::npos);
}

}  // namespace
}  // namespace lattice::io
