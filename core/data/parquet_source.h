// Parquet input for text_reader (Apache Arrow C++ from the pyarrow wheel, when the build
// found it: TITAN_HAVE_PARQUET). Kept apart so only one file sees Arrow's headers.
#pragma once

#include <memory>
#include <string>

#include "core/data/text_reader.h"

namespace titan {

// Reads the string column opts.field row by row, in record batches of at most 256 rows from
// a 1 MiB buffered page stream (no pre-buffering of whole row groups). Throws UserError for a
// file Arrow cannot read, a missing or non-string column, or a null value; without Parquet
// support, for any .parquet input.
std::unique_ptr<TextSource> open_parquet_source(const std::string& path,
                                                const TextReaderOptions& opts);

}  // namespace titan
