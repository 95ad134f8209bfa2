// Names of POSIX signals for messages ("rank 3 was killed by SIGKILL").
#pragma once

#include <string>

namespace dnallm {

// "SIGTERM", "SIGKILL", ... for the signals a job sees, else "signal N".
std::string signal_name(int sig);

}  // namespace dnallm
