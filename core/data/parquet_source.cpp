#include "core/data/parquet_source.h"

#include <filesystem>

#include "core/base/errors.h"

#ifdef TITAN_HAVE_PARQUET
#include <arrow/array.h>
#include <arrow/io/file.h>
#include <arrow/record_batch.h>
#include <arrow/type.h>
#include <parquet/arrow/reader.h>
#include <parquet/file_reader.h>
#include <parquet/metadata.h>
#include <parquet/properties.h>
#include <parquet/schema.h>
#endif

namespace titan {

bool parquet_supported() {
#ifdef TITAN_HAVE_PARQUET
  return true;
#else
  return false;
#endif
}

#ifdef TITAN_HAVE_PARQUET
namespace {

constexpr int64_t kRowsPerBatch = 256;
constexpr int64_t kPageBuffer = 1 << 20;

class ParquetSource : public TextSource {
 public:
  ParquetSource(const std::string& path, const TextReaderOptions& opts) : path_(path), opts_(opts) {
    parquet::ReaderProperties props;
    props.enable_buffered_stream();
    props.set_buffer_size(kPageBuffer);
    parquet::ArrowReaderProperties aprops;
    aprops.set_pre_buffer(false);
    aprops.set_use_threads(false);
    aprops.set_batch_size(kRowsPerBatch);
    parquet::arrow::FileReaderBuilder builder;
    check(builder.OpenFile(path, /*memory_map=*/false, props), "not a readable Parquet file");
    builder.properties(aprops);
    auto meta = builder.raw_reader()->metadata();
    std::error_code ec;
    file_size_ = static_cast<uint64_t>(std::filesystem::file_size(path, ec));
    total_rows_ = meta->num_rows();
    const parquet::SchemaDescriptor* schema = meta->schema();
    const int col = schema->ColumnIndex(opts.field);
    if (col < 0) {
      std::string names;
      for (int c = 0; c < schema->num_columns() && c < 20; ++c)
        names += (c ? ", " : "") + schema->Column(c)->path()->ToDotString();
      throw UserError("data file '" + path + "': has no column \"" + opts.field +
                      "\"; its columns: " + names + "; pick one with --field");
    }
    auto reader = builder.Build();
    check(reader.status(), "not a readable Parquet file");
    reader_ = std::move(*reader);
    std::vector<int> groups(static_cast<size_t>(meta->num_row_groups()));
    for (int g = 0; g < meta->num_row_groups(); ++g) groups[static_cast<size_t>(g)] = g;
    auto rb = reader_->GetRecordBatchReader(groups, {col});
    check(rb.status(), "cannot read column \"" + opts.field + "\"");
    batches_ = std::move(*rb);
  }

  bool next(TextBatch& b) override {
    b.clear();
    b.path = path_;
    b.format = TextFormat::kParquet;
    while (b.data.size() < opts_.batch_bytes) {
      if (!current_ || row_ >= current_->length()) {
        std::shared_ptr<arrow::RecordBatch> rb;
        check(batches_->ReadNext(&rb), "cannot read column \"" + opts_.field + "\"");
        if (!rb) break;
        current_ = rb->column(0);
        row_ = 0;
        // A column stored with Arrow's dictionary type (pyarrow writes one for a categorical)
        // is read through its dictionary.
        dict_ = nullptr;
        values_ = current_;
        if (current_->type_id() == arrow::Type::DICTIONARY) {
          dict_ = std::static_pointer_cast<arrow::DictionaryArray>(current_);
          values_ = dict_->dictionary();
        }
        if (!is_text(*values_->type()))
          throw UserError("data file '" + path_ + "': column \"" + opts_.field + "\" has type " +
                          current_->type()->ToString() + "; allowed: string or binary");
        continue;
      }
      if (current_->IsNull(row_))
        throw UserError("data file '" + path_ + "' row " + std::to_string(rows_done_) +
                        ": column \"" + opts_.field + "\" is null; allowed: a string");
      b.data.append(view(row_));
      b.ends.push_back(b.data.size());
      b.offsets.push_back(static_cast<uint64_t>(rows_done_));
      ++row_;
      ++rows_done_;
    }
    if (!b.ends.empty()) return true;
    if (rows_done_ == 0) throw UserError("data file '" + path_ + "': holds no documents");
    return false;
  }
  uint64_t bytes_done() const override {
    return total_rows_ ? static_cast<uint64_t>(static_cast<double>(file_size_) * rows_done_ /
                                               static_cast<double>(total_rows_))
                       : 0;
  }
  uint64_t bytes_total() const override { return file_size_; }

 private:
  void check(const arrow::Status& st, const std::string& what) const {
    if (!st.ok())
      throw UserError("data file '" + path_ + "': " + what + " (arrow: " + st.message() + ")");
  }
  static bool is_text(const arrow::DataType& t) {
    switch (t.id()) {
      case arrow::Type::STRING:
      case arrow::Type::LARGE_STRING:
      case arrow::Type::STRING_VIEW:
      case arrow::Type::BINARY:
      case arrow::Type::LARGE_BINARY:
      case arrow::Type::BINARY_VIEW:
        return true;
      default:
        return false;
    }
  }
  std::string_view view(int64_t row) const {
    const int64_t i = dict_ ? dict_->GetValueIndex(row) : row;
    switch (values_->type_id()) {
      case arrow::Type::STRING:
      case arrow::Type::BINARY:
        return static_cast<const arrow::BinaryArray&>(*values_).GetView(i);
      case arrow::Type::LARGE_STRING:
      case arrow::Type::LARGE_BINARY:
        return static_cast<const arrow::LargeBinaryArray&>(*values_).GetView(i);
      default:
        return static_cast<const arrow::BinaryViewArray&>(*values_).GetView(i);
    }
  }

  std::string path_;
  TextReaderOptions opts_;
  std::unique_ptr<parquet::arrow::FileReader> reader_;
  std::unique_ptr<arrow::RecordBatchReader> batches_;
  std::shared_ptr<arrow::Array> current_, values_;
  std::shared_ptr<arrow::DictionaryArray> dict_;
  int64_t row_ = 0, rows_done_ = 0, total_rows_ = 0;
  uint64_t file_size_ = 0;
};

}  // namespace

std::unique_ptr<TextSource> open_parquet_source(const std::string& path,
                                                const TextReaderOptions& opts) {
  return std::make_unique<ParquetSource>(path, opts);
}

#else

std::unique_ptr<TextSource> open_parquet_source(const std::string& path, const TextReaderOptions&) {
  throw UserError("data file '" + path +
                  "': Parquet input needs Apache Arrow, and this build has none (configure "
                  "found no pyarrow in TITAN_PYTHON); allowed: .txt, .jsonl, .jsonl.gz, "
                  ".jsonl.zst");
}

#endif

}  // namespace titan
