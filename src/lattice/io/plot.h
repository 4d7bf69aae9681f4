// Dependency-free SVG line charts: loss and throughput curves drawn from a
// metrics JSONL file, and anything else with (x, y) series.
//
// Axes get "nice" ticks (1, 2, 5 x 10^k) with light grid lines, a title, axis
// labels and a legend. NaN points break a line (a series with gaps, such as
// val_loss that exists only on evaluation steps, is drawn with point markers).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace lattice::io {

struct PlotSeries {
  std::string name;
  std::vector<double> xs, ys;  // same length; NaN = no point
};

struct PlotOptions {
  int width = 800;
  int height = 480;
};

// The SVG document as text.
std::string svg_plot(const std::string& title, const std::vector<PlotSeries>& series, const std::string& x_label,
                     const std::string& y_label, const PlotOptions& options = {});
// Writes svg_plot(...) to path.
void write_svg_plot(const std::string& path, const std::string& title, const std::vector<PlotSeries>& series,
                    const std::string& x_label, const std::string& y_label, const PlotOptions& options = {});

// A Gantt chart: one row per name (top to bottom), boxes from start to end on
// a shared time axis, each filled with its colour and labelled with its
// text when it is wide enough; `legend` pairs a colour with what it means.
struct GanttBox {
  int row = 0;
  double start = 0, end = 0;
  std::string label;
  std::string color;  // any SVG colour
};
std::string svg_gantt(const std::string& title, const std::vector<std::string>& rows, const std::vector<GanttBox>& boxes,
                      const std::string& x_label, const std::vector<std::pair<std::string, std::string>>& legend,
                      const PlotOptions& options = {});

// From a metrics JSONL file: <out_prefix>loss.svg (loss, and val_loss when
// present, against step) and <out_prefix>throughput.svg (tokens_per_sec against
// step). Returns the paths written.
std::vector<std::string> plot_metrics(const std::string& metrics_path, const std::string& out_prefix);
// Several runs side by side: for each of "loss" and "val_loss" that every
// file has, <out_prefix><column>.svg with one line per file, named by
// `names` (the same length as `paths`). Returns the paths written.
std::vector<std::string> plot_metrics_comparison(const std::vector<std::string>& paths,
                                                 const std::vector<std::string>& names, const std::string& out_prefix);

}  // namespace lattice::io
