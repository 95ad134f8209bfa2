// Name resolution shared by whoever must pick an address to bind or to advertise: the
// standalone coordinator (coordinator/main.cpp) and rank 0's store (comm/bootstrap.cpp);
// and the job token both the coordinator and the launcher generate.
#pragma once

#include <string>
#include <vector>

namespace dnallm::coordinator {

// Every IPv4 address (dotted quad) `host` resolves to on this machine, in resolver order;
// empty when it does not resolve.
std::vector<std::string> resolve_ipv4(const std::string& host);

// A new job token: 32 hex characters from /dev/urandom.
std::string generate_job_token();

}  // namespace dnallm::coordinator
