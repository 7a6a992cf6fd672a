// Copies between memories and layouts: an array of structures in host memory becomes a
// structure of arrays in a file and comes back; the planner picks each path, and the report
// says which it took.
// Run: build/release/apps/examples/example_copy
#include <caravan/caravan.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>

struct Particle {
  float mass;
  double velocity;
};

namespace {

int run() {
  caravan::Runtime rt;
  // Two fields per point; one million points in one dimension.
  caravan::FieldSpace fields({{"mass", sizeof(float)}, {"velocity", sizeof(double)}});
  const caravan::Rect space = caravan::Rect::from_extents({1 << 20});
  // Memories are named node/rank/kind: `caravan machine show` lists this machine's (sys: host
  // memory, dsk: files in CARAVAN_DSK_DIR; with GPUs also zcm and fbm<i>). local_memory() names
  // this rank's, so the same code is right on every rank of a job.
  const caravan::MemoryId host = caravan::local_memory(caravan::MemoryKind::sys);
  const caravan::MemoryId disk = caravan::local_memory(caravan::MemoryKind::dsk);
  // "F,x": fields innermost (an array of structures); "x,F": one array per field.
  auto aos = caravan::Instance::create(host, space, fields, caravan::Layout::parse("F,x"));
  auto soa = caravan::Instance::create(disk, space, fields, caravan::Layout::parse("x,F"));
  auto back = caravan::Instance::create(host, space, fields, caravan::Layout::parse("F,x"));

  // Fill the source through its bytes: point i's fields sit at offset(point, field).
  for (std::int64_t i = 0; i < (1 << 20); ++i) {
    const Particle p{static_cast<float>(i % 1000), 0.5 * static_cast<double>(i)};
    std::memcpy(aos.data() + aos.offset(caravan::Point{i}, 0), &p.mass, sizeof p.mass);
    std::memcpy(aos.data() + aos.offset(caravan::Point{i}, 1), &p.velocity, sizeof p.velocity);
  }
  std::memset(back.data(), 0xFF, back.footprint_bytes());  // poisoned: every byte must be written

  // The second copy starts once the first has finished: copies are ordered by events, like tasks.
  caravan::CopyReport out_report, in_report;
  caravan::Event out = caravan::copy(aos, soa, {.report = &out_report});
  caravan::Event in = caravan::copy(soa, back, {.precondition = out, .report = &in_report});
  in.wait();
  std::printf("to the file:   %s (%llu tiles)\n", out_report.route.c_str(), static_cast<unsigned long long>(out_report.tiles));
  std::printf("and back:      %s (%llu tiles)\n", in_report.route.c_str(), static_cast<unsigned long long>(in_report.tiles));

  if (std::memcmp(aos.data(), back.data(), aos.footprint_bytes()) != 0) {
    std::printf("the round trip changed the data\n");
    return 1;
  }
  std::printf("%llu bytes there and back, unchanged\n", static_cast<unsigned long long>(aos.footprint_bytes()));

  // Part of an instance: a region copies only its points, here points 1000..1999 of the file
  // into a small instance that holds just those (its space is the region; points keep their
  // coordinates).
  const caravan::Rect part(1, caravan::Point{1000}, caravan::Point{1999});
  auto slice = caravan::Instance::create(host, part, fields, caravan::Layout::parse("F,x"));
  caravan::copy(soa, slice, {.region = part}).wait();
  float mass = 0;
  std::memcpy(&mass, slice.data() + slice.offset(caravan::Point{1234}, 0), sizeof mass);
  if (mass != 234.0f) {
    std::printf("the region copy put %g at point 1234, not 234\n", static_cast<double>(mass));
    return 1;
  }
  std::printf("points 1000..1999 of the file copied on their own (point 1234's mass: %g)\n", static_cast<double>(mass));
  return 0;
}

}  // namespace

// Caravan reports errors as exceptions: caravan::Error (a code and a message naming what was
// refused, e.g. a bad CARAVAN_DSK_DIR), and EventPoisoned from a wait on an event whose work failed.
int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_copy: %s\n", e.what());
    return 1;
  }
}
