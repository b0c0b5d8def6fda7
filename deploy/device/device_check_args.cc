// The device check's argument validation alone (device_check_args.h): what
// deploy/device/device_check.sh compiles with the host compiler and runs on the
// checker's command line before the nvcc build. Exit 0 the arguments are
// good and --json can be written; 2 not (the reason on stderr).
#include "deploy/device/device_check_args.h"

int main(int argc, char** argv) {
  gtopk::device_check::Options o;
  return gtopk::device_check::ValidateArgs(argc, argv, &o);
}
