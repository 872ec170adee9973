#include <stdint.h>
#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>
#include <slurm/slurm_version.h>
#include <slurm/spank.h>

/* The host functions the plugins call, as pointer types: slurm-ffi's prototypes for them come
 * from these headers, whatever the release (src/host.rs). The printf-like log functions
 * (variadic), Slurm's allocator (in no installed header) and slurm_get_errno (gone from the
 * headers in 24.11, where errno says it) stay written by hand there. */
typedef __typeof__(&spank_option_register) multiplex_spank_option_register_f;
typedef __typeof__(&spank_getenv) multiplex_spank_getenv_f;
typedef __typeof__(&spank_setenv) multiplex_spank_setenv_f;
typedef __typeof__(&spank_job_control_setenv) multiplex_spank_job_control_setenv_f;
typedef __typeof__(&spank_context) multiplex_spank_context_f;
typedef __typeof__(&slurm_hostlist_create) multiplex_hostlist_create_f;
typedef __typeof__(&slurm_hostlist_shift) multiplex_hostlist_shift_f;
typedef __typeof__(&slurm_hostlist_find) multiplex_hostlist_find_f;
typedef __typeof__(&slurm_hostlist_destroy) multiplex_hostlist_destroy_f;
typedef __typeof__(&slurm_strerror) multiplex_strerror_f;
typedef __typeof__(&slurm_load_job) multiplex_load_job_f;
typedef __typeof__(&slurm_free_job_info_msg) multiplex_free_job_info_msg_f;
