// `titan-train generate`: text from a trained checkpoint or a Hugging Face folder, for every
// model family (docs/models.md, "Generation").
#pragma once

namespace titan {

// argv[0] is "generate". The continuation on stdout, tokens/s on stderr; UserError for bad
// input (exit 2).
int run_generate_command(int argc, char** argv);

}  // namespace titan
