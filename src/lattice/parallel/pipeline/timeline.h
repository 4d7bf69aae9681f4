// A pipeline timeline (simulated, or recorded by the executor) as Chrome
// trace JSON: one thread per rank, one complete event ("ph": "X") per action,
// named as the schedule writes it ("1F3"); it opens in Perfetto
// (ui.perfetto.dev) and chrome://tracing. `lattice inspect TRACE --plot`
// draws it as an SVG Gantt chart.
#pragma once

#include <string>
#include <vector>

#include "lattice/parallel/pipeline/simulator.h"

namespace lattice::pipeline {

// Times are multiplied by `seconds_per_unit` (1 for measured seconds; any
// scale for the simulator's unit costs) and written in microseconds.
std::string chrome_trace(const std::vector<std::vector<Interval>>& timeline, double seconds_per_unit,
                         const std::string& title);

// Busy share of ranks × span, the measured counterpart of Simulation::bubble.
double bubble_of(const std::vector<std::vector<Interval>>& timeline);

}  // namespace lattice::pipeline
