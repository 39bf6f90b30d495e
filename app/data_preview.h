// `titan-train data-preview`: which windows the first steps of a run read, without training.
#pragma once

namespace titan {

// argv[0] is "data-preview"; the other arguments are the training flags plus --steps N,
// --rank R and --world W. Prints one JSON line per window to stdout.
int run_data_preview(int argc, char** argv);

}  // namespace titan
