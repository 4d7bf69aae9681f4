#include "lattice/io/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "lattice/core/error.h"
#include "lattice/io/file_util.h"
#include "lattice/io/metrics.h"

namespace lattice::io {

namespace {

// Colour-blind friendly palette (Okabe-Ito, then a few more).
constexpr const char* kColors[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                                   "#E69F00", "#56B4E9", "#000000", "#999999"};

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", x);
  return buf;
}

struct Axis {
  double lo, hi, step;  // range rounded out to whole ticks

  // Tick positions, counted by index so rounding can never stall the loop.
  std::vector<double> ticks() const {
    std::vector<double> t;
    double n = std::round((hi - lo) / step);
    if (!std::isfinite(n) || n < 0 || n > 100) return {lo, hi};
    for (int i = 0; i <= static_cast<int>(n); ++i) t.push_back(lo + i * step);
    return t;
  }
};

// About `target` ticks at 1, 2 or 5 x 10^k over [lo, hi].
Axis nice_axis(double lo, double hi, int target) {
  if (!(hi > lo)) {  // one value (or none): open a window around it
    double pad = lo == 0 ? 1.0 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  double raw = (hi - lo) / target;
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double norm = raw / mag;
  double step = (norm < 1.5 ? 1 : norm < 3.5 ? 2 : norm < 7.5 ? 5 : 10) * mag;
  Axis a{std::floor(lo / step + 1e-9) * step, std::ceil(hi / step - 1e-9) * step, step};
  // Degenerate input (values near the double limits): a unit frame rather than NaN coordinates.
  if (!(std::isfinite(a.lo) && std::isfinite(a.hi) && a.hi > a.lo && step > 0)) return {0, 1, 0.2};
  return a;
}

// Tick label: enough decimals for the step; k / M / G for large values.
std::string tick_label(double v, double step) {
  if (std::fabs(v) < step * 1e-6) v = 0;
  const char* suffix = "";
  double scale = 1;
  double big = std::max(std::fabs(v), step);
  if (big >= 1e9) { scale = 1e9; suffix = "G"; }
  else if (big >= 1e6) { scale = 1e6; suffix = "M"; }
  else if (big >= 1e4) { scale = 1e3; suffix = "k"; }
  double s = step / scale;
  int decimals = s >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(s) - 1e-9));
  decimals = std::min(decimals, 9);
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f%s", decimals, v / scale, suffix);
  return buf;
}

// The document's opening: size, white background, the title.
std::string svg_header(double W, double H, const std::string& title) {
  return "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(W) + "\" height=\"" + num(H) + "\" viewBox=\"0 0 " +
         num(W) + " " + num(H) + "\" font-family=\"Helvetica, Arial, sans-serif\">\n" +
         "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n" + "<text x=\"" + num(W / 2) +
         "\" y=\"26\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\">" + xml_escape(title) + "</text>\n";
}

}  // namespace

std::string svg_plot(const std::string& title, const std::vector<PlotSeries>& series, const std::string& x_label,
                     const std::string& y_label, const PlotOptions& options) {
  const double W = options.width, H = options.height;
  const double left = 78, right = 24, top = 44, bottom = 56;
  const double pw = W - left - right, ph = H - top - bottom;

  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin, ymin = xmin, ymax = -xmin;
  for (const PlotSeries& s : series) {
    LATTICE_CHECK(s.xs.size() == s.ys.size(), "plot series '" << s.name << "' has " << s.xs.size() << " x values and "
                                                              << s.ys.size() << " y values");
    for (size_t i = 0; i < s.xs.size(); ++i) {
      if (!std::isfinite(s.xs[i]) || !std::isfinite(s.ys[i])) continue;
      xmin = std::min(xmin, s.xs[i]);
      xmax = std::max(xmax, s.xs[i]);
      ymin = std::min(ymin, s.ys[i]);
      ymax = std::max(ymax, s.ys[i]);
    }
  }
  if (!std::isfinite(xmin)) xmin = xmax = ymin = ymax = 0;  // no points: an empty frame
  Axis ax = nice_axis(xmin, xmax, 8);
  Axis ay = nice_axis(ymin, ymax, 6);
  auto px = [&](double x) { return left + (x - ax.lo) / (ax.hi - ax.lo) * pw; };
  auto py = [&](double y) { return top + ph - (y - ay.lo) / (ay.hi - ay.lo) * ph; };

  std::string o = svg_header(W, H, title);

  // Grid and tick labels.
  o += "<g stroke=\"#e5e5e5\" stroke-width=\"1\">\n";
  for (double t : ax.ticks())
    o += "<line x1=\"" + num(px(t)) + "\" y1=\"" + num(top) + "\" x2=\"" + num(px(t)) + "\" y2=\"" + num(top + ph) + "\"/>\n";
  for (double t : ay.ticks())
    o += "<line x1=\"" + num(left) + "\" y1=\"" + num(py(t)) + "\" x2=\"" + num(left + pw) + "\" y2=\"" + num(py(t)) + "\"/>\n";
  o += "</g>\n<g font-size=\"12\" fill=\"#333\">\n";
  for (double t : ax.ticks())
    o += "<text x=\"" + num(px(t)) + "\" y=\"" + num(top + ph + 18) + "\" text-anchor=\"middle\">" +
         tick_label(t, ax.step) + "</text>\n";
  for (double t : ay.ticks())
    o += "<text x=\"" + num(left - 8) + "\" y=\"" + num(py(t) + 4) + "\" text-anchor=\"end\">" +
         tick_label(t, ay.step) + "</text>\n";
  o += "</g>\n";
  o += "<rect x=\"" + num(left) + "\" y=\"" + num(top) + "\" width=\"" + num(pw) + "\" height=\"" + num(ph) +
       "\" fill=\"none\" stroke=\"#333\" stroke-width=\"1\"/>\n";
  o += "<text x=\"" + num(left + pw / 2) + "\" y=\"" + num(H - 14) + "\" text-anchor=\"middle\" font-size=\"13\">" +
       xml_escape(x_label) + "</text>\n";
  o += "<text transform=\"translate(18 " + num(top + ph / 2) + ") rotate(-90)\" text-anchor=\"middle\" font-size=\"13\">" +
       xml_escape(y_label) + "</text>\n";

  // Lines: one polyline per run of finite points; markers for sparse series.
  for (size_t si = 0; si < series.size(); ++si) {
    const PlotSeries& s = series[si];
    const char* color = kColors[si % (sizeof kColors / sizeof kColors[0])];
    size_t finite = 0;
    for (size_t i = 0; i < s.xs.size(); ++i) finite += std::isfinite(s.xs[i]) && std::isfinite(s.ys[i]);
    bool markers = finite > 0 && (finite <= 60 || finite * 2 < s.xs.size());
    std::string points;
    auto flush = [&] {
      if (points.find(' ') != std::string::npos)
        o += "<polyline fill=\"none\" stroke=\"" + std::string(color) + "\" stroke-width=\"1.8\" " +
             "stroke-linejoin=\"round\" points=\"" + points + "\"/>\n";
      points.clear();
    };
    std::string dots;
    for (size_t i = 0; i < s.xs.size(); ++i) {
      if (!std::isfinite(s.xs[i]) || !std::isfinite(s.ys[i])) {
        flush();
        continue;
      }
      if (!points.empty()) points += ' ';
      points += num(px(s.xs[i])) + "," + num(py(s.ys[i]));
      if (markers) dots += "<circle cx=\"" + num(px(s.xs[i])) + "\" cy=\"" + num(py(s.ys[i])) + "\" r=\"2.8\"/>\n";
    }
    flush();
    if (!dots.empty()) o += "<g fill=\"" + std::string(color) + "\">\n" + dots + "</g>\n";
  }

  // Legend, top right inside the plot area.
  if (!series.empty()) {
    size_t longest = 0;
    for (const PlotSeries& s : series) longest = std::max(longest, s.name.size());
    double lw = 44 + 7.0 * static_cast<double>(longest), lh = 8 + 18.0 * static_cast<double>(series.size());
    double lx = left + pw - lw - 10, ly = top + 10;
    o += "<rect x=\"" + num(lx) + "\" y=\"" + num(ly) + "\" width=\"" + num(lw) + "\" height=\"" + num(lh) +
         "\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#bbb\"/>\n";
    for (size_t si = 0; si < series.size(); ++si) {
      const char* color = kColors[si % (sizeof kColors / sizeof kColors[0])];
      double y = ly + 16 + 18.0 * static_cast<double>(si);
      o += "<line x1=\"" + num(lx + 8) + "\" y1=\"" + num(y - 4) + "\" x2=\"" + num(lx + 30) + "\" y2=\"" + num(y - 4) +
           "\" stroke=\"" + color + "\" stroke-width=\"2.5\"/>\n";
      o += "<text x=\"" + num(lx + 36) + "\" y=\"" + num(y) + "\" font-size=\"12\">" + xml_escape(series[si].name) +
           "</text>\n";
    }
  }
  o += "</svg>\n";
  return o;
}

std::string svg_gantt(const std::string& title, const std::vector<std::string>& rows, const std::vector<GanttBox>& boxes,
                      const std::string& x_label, const std::vector<std::pair<std::string, std::string>>& legend,
                      const PlotOptions& options) {
  const double W = options.width, row_h = 28, left = 70, right = 24, top = 44, bottom = 70;
  const double ph = row_h * static_cast<double>(std::max<size_t>(rows.size(), 1)), H = top + ph + bottom;
  const double pw = W - left - right;
  double tmax = 0;
  for (const GanttBox& b : boxes) tmax = std::max(tmax, b.end);
  Axis ax = nice_axis(0, tmax > 0 ? tmax : 1, 10);
  auto px = [&](double x) { return left + (x - ax.lo) / (ax.hi - ax.lo) * pw; };
  std::string o = svg_header(W, H, title);
  for (double x : ax.ticks()) {
    o += "<line x1=\"" + num(px(x)) + "\" y1=\"" + num(top) + "\" x2=\"" + num(px(x)) + "\" y2=\"" + num(top + ph) +
         "\" stroke=\"#e5e5e5\"/>\n";
    o += "<text x=\"" + num(px(x)) + "\" y=\"" + num(top + ph + 18) + "\" text-anchor=\"middle\" font-size=\"11\">" +
         tick_label(x, ax.step) + "</text>\n";
  }
  for (size_t r = 0; r < rows.size(); ++r)
    o += "<text x=\"" + num(left - 8) + "\" y=\"" + num(top + (r + 0.5) * row_h + 4) +
         "\" text-anchor=\"end\" font-size=\"12\">" + xml_escape(rows[r]) + "</text>\n";
  for (const GanttBox& b : boxes) {
    const double x0 = px(b.start), x1 = px(b.end), y = top + b.row * row_h + 3;
    o += "<rect x=\"" + num(x0) + "\" y=\"" + num(y) + "\" width=\"" + num(std::max(0.5, x1 - x0)) + "\" height=\"" +
         num(row_h - 6) + "\" fill=\"" + xml_escape(b.color) + "\" stroke=\"white\" stroke-width=\"0.5\"/>\n";
    if (!b.label.empty() && x1 - x0 >= 7.0 * static_cast<double>(b.label.size()))
      o += "<text x=\"" + num((x0 + x1) / 2) + "\" y=\"" + num(y + (row_h - 6) / 2 + 4) +
           "\" text-anchor=\"middle\" font-size=\"10\" fill=\"white\">" + xml_escape(b.label) + "</text>\n";
  }
  o += "<rect x=\"" + num(left) + "\" y=\"" + num(top) + "\" width=\"" + num(pw) + "\" height=\"" + num(ph) +
       "\" fill=\"none\" stroke=\"#333\"/>\n";
  o += "<text x=\"" + num(left + pw / 2) + "\" y=\"" + num(top + ph + 38) + "\" text-anchor=\"middle\" font-size=\"12\">" +
       xml_escape(x_label) + "</text>\n";
  double lx = left;
  for (const auto& [color, text] : legend) {
    o += "<rect x=\"" + num(lx) + "\" y=\"" + num(top + ph + 50) + "\" width=\"14\" height=\"12\" fill=\"" +
         xml_escape(color) + "\"/>\n";
    o += "<text x=\"" + num(lx + 18) + "\" y=\"" + num(top + ph + 60) + "\" font-size=\"12\">" + xml_escape(text) +
         "</text>\n";
    lx += 30 + 7.0 * static_cast<double>(text.size());
  }
  o += "</svg>\n";
  return o;
}

void write_svg_plot(const std::string& path, const std::string& title, const std::vector<PlotSeries>& series,
                    const std::string& x_label, const std::string& y_label, const PlotOptions& options) {
  write_file_atomic(path, svg_plot(title, series, x_label, y_label, options));
}

std::vector<std::string> plot_metrics(const std::string& metrics_path, const std::string& out_prefix) {
  MetricsColumns m = read_metrics_jsonl(metrics_path);
  const std::vector<double>& step = m.column("step");
  std::vector<std::string> written;
  std::vector<PlotSeries> loss = {{"train loss", step, m.column("loss")}};
  if (m.has("val_loss")) loss.push_back({"val loss", step, m.column("val_loss")});
  written.push_back(out_prefix + "loss.svg");
  write_svg_plot(written.back(), "Loss", loss, "step", "loss");
  if (m.has("tokens_per_sec")) {
    written.push_back(out_prefix + "throughput.svg");
    write_svg_plot(written.back(), "Throughput", {{"tokens/s", step, m.column("tokens_per_sec")}}, "step",
                   "tokens per second");
  }
  return written;
}

std::vector<std::string> plot_metrics_comparison(const std::vector<std::string>& paths,
                                                 const std::vector<std::string>& names, const std::string& out_prefix) {
  LATTICE_CHECK(paths.size() == names.size() && !paths.empty(), "plot_metrics_comparison: one name per file");
  std::vector<MetricsColumns> runs;
  for (const std::string& p : paths) runs.push_back(read_metrics_jsonl(p));
  std::vector<std::string> written;
  for (const char* column : {"loss", "val_loss"}) {
    std::vector<PlotSeries> series;
    for (size_t i = 0; i < runs.size(); i++)
      if (runs[i].has(column)) series.push_back({names[i], runs[i].column("step"), runs[i].column(column)});
    if (series.size() != runs.size()) continue;
    written.push_back(out_prefix + column + ".svg");
    write_svg_plot(written.back(), std::string(column) == "loss" ? "Training loss" : "Validation loss", series,
                   "step", column);
  }
  return written;
}

}  // namespace lattice::io
