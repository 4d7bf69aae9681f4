// What `lattice schedule` and `lattice inspect` print about a pipeline
// schedule or a timeline, and the files they draw.
#pragma once

#include <string>
#include <vector>

#include "lattice/parallel/pipeline/schedule.h"
#include "lattice/parallel/pipeline/simulator.h"

namespace lattice::cli {

// Validates and simulates `s` with `costs`, prints the lists, makespan,
// bubble (and the textbook formula of a generated schedule at equal costs)
// and peak in-flight micro-batches per rank.
pipeline::Simulation print_schedule_report(const pipeline::Schedule& s, const pipeline::Costs& costs);

// The SVG Gantt chart of a timeline: ranks down, time across, F/B/I/W coloured,
// micro-batch numbers in the boxes.
void write_timeline_svg(const std::string& path, const std::vector<std::vector<pipeline::Interval>>& timeline,
                        const std::string& title, const std::string& x_label);

// A Chrome trace JSON file written by pipeline::chrome_trace (times in seconds).
std::vector<std::vector<pipeline::Interval>> read_chrome_trace(const std::string& path);

}  // namespace lattice::cli
