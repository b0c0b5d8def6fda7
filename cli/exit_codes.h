// The exit codes of gtopk-server and gtopk-worker: one per kind of fault,
// the same in both programs (server/flags.md and worker/flags.md, "Exit
// codes", list when each program uses which).
#ifndef GTOPK_CLI_EXIT_CODES_H_
#define GTOPK_CLI_EXIT_CODES_H_

namespace gtopk {
namespace cli {

// The work is done: a graceful shutdown, a SERVING health check, a finished
// training run.
inline constexpr int kExitOk = 0;

// The work itself failed: a health check that is not SERVING (or cannot be
// made), a training run that failed (the cluster unreachable or refusing the
// join, a failed step, a configuration mismatch with the servers, diverged
// replicas). Also what Abseil's --help and --helpfull end with, and what
// its parser exits with for a syntax error in a --flagfile
// (cli/command_line.h).
inline constexpr int kExitFailure = 1;

// Nothing was started: an invalid command line (an unknown flag, a value
// that does not parse or is out of range, a stray argument, --tls missing)
// or a startup that failed before any work (a port, certificate, checkpoint
// or data file that cannot be used). Running the same command again gives
// the same result: a supervisor should not restart on it.
inline constexpr int kExitUsage = 2;

// gtopk-server only: a graceful shutdown whose final checkpoint could not be
// written (the previous checkpoint is intact; a restart restores it).
inline constexpr int kExitCheckpointFailed = 3;

}  // namespace cli
}  // namespace gtopk

#endif  // GTOPK_CLI_EXIT_CODES_H_
