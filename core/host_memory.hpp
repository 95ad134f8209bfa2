// How much memory this machine lets the process allocate, read from Linux (torch-free).
#pragma once

namespace dnallm {

// /proc/meminfo's MemAvailable in bytes; 0 when unknown.
double mem_available_bytes();

// Bytes this process may still allocate: MemAvailable, lowered to the cgroup v2 limit's
// headroom (memory.max - memory.current) when there is one; 0 when unknown.
double available_memory_bytes();

// The most resident memory this process has held so far (getrusage's ru_maxrss), in MB.
double peak_rss_mb();

}  // namespace dnallm
