// Whole small files: the one reader (configs, tokenizer.json, checkpoint metadata, Hugging
// Face config files) and durable writes (checkpoints, exports, safetensors files).
#pragma once

#include <string>

namespace titan {

// The whole file at `path`. Throws UserError "<what> '<path>': does not exist / is a folder /
// cannot be read (<reason>)"; `what` names the file's role, e.g. "config file".
std::string read_file(const std::string& path, const std::string& what);

// Writes `text` to `path` durably: to <path>.tmp first, fsynced, then renamed over `path`,
// so a crash leaves the old file or the new one. Throws UserError naming the file.
void write_file_durable(const std::string& path, const std::string& text);

// fsyncs a folder so the renames in it survive a crash. Best effort: some file systems
// refuse fsync on folders.
void fsync_dir(const std::string& dir);

}  // namespace titan
