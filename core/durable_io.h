// Durable small writes, shared by checkpoints, Hugging Face exports and safetensors files.
#pragma once

#include <string>

namespace titan {

// Writes `text` to `path` durably: to <path>.tmp first, fsynced, then renamed over `path`,
// so a crash leaves the old file or the new one. Throws UserError naming the file.
void write_file_durable(const std::string& path, const std::string& text);

// fsyncs a folder so the renames in it survive a crash. Best effort: some file systems
// refuse fsync on folders.
void fsync_dir(const std::string& dir);

}  // namespace titan
