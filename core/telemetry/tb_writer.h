// Scalar summaries in TensorBoard's event-file format, written without TensorFlow or protobuf:
// the few Event/Summary fields we need are encoded by hand and framed as TFRecords.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace titan {

class TensorBoardWriter {
 public:
  // Creates `folder` if needed and opens a new event file in it named like TensorBoard's own
  // (events.out.tfevents.<unix_seconds>.<hostname>.<pid>.titan). Throws UserError.
  explicit TensorBoardWriter(const std::string& folder);
  // A fixed file name and first-event wall time, so tests get byte-for-byte known output.
  TensorBoardWriter(const std::string& folder, const std::string& file_name, double wall_time);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // TensorBoard stores scalars as float32, so `value` is rounded to float here.
  void add_scalar(const std::string& tag, double value, int64_t step);
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time);
  // Records may sit in a buffer until this or the destructor; call it once per logging step
  // so a live TensorBoard (or a crash) sees everything logged so far.
  void flush();

  const std::string& path() const { return path_; }

 private:
  void open(const std::string& folder, const std::string& file_name, double wall_time);
  void write_record(const std::string& data);

  std::string path_;
  std::ofstream out_;
};

}  // namespace titan
