//! `srun --multiplex` making its own job. srun builds the job's request and its step's request
//! from the same options, and job_submit turns the job's GPUs into shares of one: a step that
//! still asks for `gpu` then finds none in its job ("Step requested GRES (gpu:(null)) not
//! found in the job"). So the SPANK plugin in srun takes the GPU asks off srun's options (a
//! step that asks for no GPU gets its job's, here the shared one) and hands them to job_submit
//! in the job's SPANK environment under [`GPU_REQUEST_ENV`], where job_submit counts them as
//! the job's own.
//!
//! The asks are the user's own request in another envelope: job_submit applies the same
//! policy to them as to `--gres`, and reads them only for jobs with `--multiplex`.

/// The SPANK job-environment variable that carries srun's GPU asks to job_submit.
pub const GPU_REQUEST_ENV: &str = "MULTIPLEX_SRUN_GPUS";

/// What a step of a multiplexed job asks for: one share of its job's GPU, without a type.
/// Once the claimer has typed the job's shard (`shard:v100_1:1`), Slurm (22.05 and 24.11
/// alike) refuses a step that asks for no gres ("Invalid generic resource (gres)
/// specification") or for the typed shard, and gives one that asks for `shard:1` the job's
/// GPU. srun making its own job sends it with the job's request too: job_submit takes it off
/// again ([`without_step_share`]).
pub const STEP_SHARE: &str = "shard:1";

/// srun's `--gres` for a step of a multiplexed job: the entries that are not GPUs (`keep`),
/// and [`STEP_SHARE`].
pub fn step_gres(keep: Option<&str>) -> String {
    match keep.filter(|k| !k.is_empty()) {
        Some(k) => format!("{k},{STEP_SHARE}"),
        None => STEP_SHARE.to_string(),
    }
}

/// A job request's `tres_per_node` (`gres:tmpdisk:10,gres:shard:1`) without the one
/// [`STEP_SHARE`] entry srun added to it for its step; `None` when nothing is left.
pub fn without_step_share(tres_per_node: &str) -> Option<String> {
    let mut removed = false;
    let kept: Vec<&str> = tres_per_node
        .split(',')
        .filter(|e| {
            let bare = e.strip_prefix("gres:").or_else(|| e.strip_prefix("gres/")).unwrap_or(e);
            let drop = !removed && bare == STEP_SHARE;
            removed |= drop;
            !drop && !e.is_empty()
        })
        .collect();
    (!kept.is_empty()).then(|| kept.join(","))
}

/// The job description fields an srun GPU option becomes (names as in `job_desc_msg_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    TresPerNode,
    TresPerJob,
    TresPerTask,
    TresPerSocket,
    CpusPerTres,
    MemPerTres,
}

impl Field {
    const ALL: [Field; 6] = [
        Field::TresPerNode,
        Field::TresPerJob,
        Field::TresPerTask,
        Field::TresPerSocket,
        Field::CpusPerTres,
        Field::MemPerTres,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Field::TresPerNode => "tres_per_node",
            Field::TresPerJob => "tres_per_job",
            Field::TresPerTask => "tres_per_task",
            Field::TresPerSocket => "tres_per_socket",
            Field::CpusPerTres => "cpus_per_tres",
            Field::MemPerTres => "mem_per_tres",
        }
    }
}

/// srun's options that ask for GPUs or depend on them, by the names `slurm_option_get` knows,
/// in the order [`move_gpu_asks`] takes their values.
pub const OPTIONS: [&str; 7] = [
    "gres",
    "gpus",
    "gpus-per-node",
    "gpus-per-task",
    "gpus-per-socket",
    "cpus-per-gpu",
    "mem-per-gpu",
];

/// What to do to srun's options: reset `reset`, then set `gres` to `keep_gres` where given
/// (the entries that are not GPUs), and pass `carry` on to job_submit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Moved {
    pub reset: Vec<&'static str>,
    pub keep_gres: Option<String>,
    pub carry: Vec<(Field, String)>,
}

/// `(gres:|gres/)NAME[:...]` is a GPU entry when NAME is `gpu`.
fn is_gpu_entry(e: &str) -> bool {
    let rest = e.strip_prefix("gres:").or_else(|| e.strip_prefix("gres/")).unwrap_or(e);
    rest.split(':').next() == Some("gpu")
}

/// Slurm's `mbytes_to_str` back to MiB: `512`, `512M`, `16G`, `1T`, `1P`.
fn mbytes(s: &str) -> Option<u64> {
    let (num, shift) = match s.as_bytes().last()? {
        b'M' | b'm' => (&s[..s.len() - 1], 0),
        b'G' | b'g' => (&s[..s.len() - 1], 10),
        b'T' | b't' => (&s[..s.len() - 1], 20),
        b'P' | b'p' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    num.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

/// Given the values srun's [`OPTIONS`] have (`None` or empty where unset, as
/// `slurm_option_get` returns them), which to take off and what job_submit must be told, in
/// TRES strings whose gres are written `{gres_prefix}gpu:...` (`gres:` up to Slurm 22.05,
/// `gres/` from 23.02). Nothing moves unless some option asks for GPUs.
pub fn move_gpu_asks(values: &[Option<String>; 7], gres_prefix: &str) -> Moved {
    let set = |i: usize| values[i].as_deref().map(str::trim).filter(|v| !v.is_empty());
    let mut m = Moved::default();
    if let Some(gres) = set(0).filter(|g| !g.eq_ignore_ascii_case("none")) {
        let entries: Vec<&str> = gres.split(',').map(str::trim).filter(|e| !e.is_empty()).collect();
        let (gpu, other): (Vec<&str>, Vec<&str>) = entries.into_iter().partition(|e| is_gpu_entry(e));
        if !gpu.is_empty() {
            m.reset.push(OPTIONS[0]);
            m.carry.push((Field::TresPerNode, gpu.join(",")));
            if !other.is_empty() {
                // srun prepends "gres:" itself when the option is set again.
                let bare: Vec<&str> = other
                    .iter()
                    .map(|e| e.strip_prefix("gres:").or_else(|| e.strip_prefix("gres/")).unwrap_or(e))
                    .collect();
                m.keep_gres = Some(bare.join(","));
            }
        }
    }
    for (i, field) in [
        (1, Field::TresPerJob),
        (2, Field::TresPerNode),
        (3, Field::TresPerTask),
        (4, Field::TresPerSocket),
    ] {
        if let Some(v) = set(i) {
            m.reset.push(OPTIONS[i]);
            m.carry.push((field, format!("{gres_prefix}gpu:{v}")));
        }
    }
    if m.reset.is_empty() {
        return Moved::default();
    }
    if let Some(v) = set(5).filter(|v| *v != "0") {
        m.reset.push(OPTIONS[5]);
        m.carry.push((Field::CpusPerTres, format!("{gres_prefix}gpu:{v}")));
    }
    if let Some(mb) = set(6).and_then(mbytes) {
        m.reset.push(OPTIONS[6]);
        m.carry.push((Field::MemPerTres, format!("{gres_prefix}gpu:{mb}")));
    }
    m
}

/// `field=value;field=value`: TRES strings hold neither `;` nor `=` in their field names.
pub fn encode(carry: &[(Field, String)]) -> String {
    carry
        .iter()
        .map(|(f, v)| format!("{}={v}", f.name()))
        .collect::<Vec<_>>()
        .join(";")
}

/// At most 64 characters of `s`, for an error that quotes what a client or a user sent.
pub fn cut(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// The inverse of [`encode`]; an unknown field or a part without `=` is an error naming it
/// (cut short: a client other than the plugin may have written anything there).
pub fn decode(s: &str) -> Result<Vec<(Field, String)>, String> {
    s.split(';')
        .filter(|p| !p.is_empty())
        .map(|part| {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{:?} is not FIELD=VALUE", cut(part)))?;
            let field = Field::ALL
                .into_iter()
                .find(|f| f.name() == name)
                .ok_or_else(|| format!("{:?} is not a field srun's GPU options become", cut(name)))?;
            Ok((field, value.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(pairs: &[(&str, &str)]) -> [Option<String>; 7] {
        let mut v: [Option<String>; 7] = Default::default();
        for (name, value) in pairs {
            let i = OPTIONS.iter().position(|o| o == name).unwrap();
            v[i] = Some(value.to_string());
        }
        v
    }

    #[test]
    fn a_step_asks_for_one_untyped_share_beside_what_is_not_a_gpu() {
        assert_eq!(step_gres(None), "shard:1");
        assert_eq!(step_gres(Some("tmpdisk:10")), "tmpdisk:10,shard:1");
        assert_eq!(without_step_share("gres:shard:1"), None);
        assert_eq!(
            without_step_share("gres/tmpdisk:10,gres/shard:1").as_deref(),
            Some("gres/tmpdisk:10")
        );
        // Only the one srun added: a second is the user's, for job_submit to refuse.
        assert_eq!(
            without_step_share("gres:shard:1,gres:shard:1").as_deref(),
            Some("gres:shard:1")
        );
    }

    #[test]
    fn gres_gpu_moves_and_other_gres_stays() {
        let m = move_gpu_asks(&values(&[("gres", "gres:gpu:1")]), "gres:");
        assert_eq!(m.reset, ["gres"]);
        assert_eq!(m.keep_gres, None);
        assert_eq!(m.carry, [(Field::TresPerNode, "gres:gpu:1".to_string())]);

        let m = move_gpu_asks(&values(&[("gres", "gres:tmpdisk:10,gres:gpu:tesla:2")]), "gres:");
        assert_eq!(m.reset, ["gres"]);
        assert_eq!(m.keep_gres.as_deref(), Some("tmpdisk:10"));
        assert_eq!(m.carry, [(Field::TresPerNode, "gres:gpu:tesla:2".to_string())]);
    }

    #[test]
    fn each_gpu_option_goes_to_its_field_with_its_companions() {
        let m = move_gpu_asks(
            &values(&[
                ("gpus", "2"),
                ("gpus-per-task", "1"),
                ("cpus-per-gpu", "4"),
                ("mem-per-gpu", "16G"),
            ]),
            "gres:",
        );
        assert_eq!(m.reset, ["gpus", "gpus-per-task", "cpus-per-gpu", "mem-per-gpu"]);
        assert_eq!(
            m.carry,
            [
                (Field::TresPerJob, "gres:gpu:2".to_string()),
                (Field::TresPerTask, "gres:gpu:1".to_string()),
                (Field::CpusPerTres, "gres:gpu:4".to_string()),
                (Field::MemPerTres, "gres:gpu:16384".to_string()),
            ]
        );
        // Slurm 23.02 and later write gres/.
        let m = move_gpu_asks(
            &values(&[("gpus-per-node", "v100:1"), ("gpus-per-socket", "1")]),
            "gres/",
        );
        assert_eq!(
            m.carry,
            [
                (Field::TresPerNode, "gres/gpu:v100:1".to_string()),
                (Field::TresPerSocket, "gres/gpu:1".to_string()),
            ]
        );
    }

    #[test]
    fn nothing_moves_without_a_gpu_ask() {
        for v in [
            values(&[]),
            values(&[("gres", "gres:tmpdisk:10")]),
            values(&[("gres", "none")]),
            values(&[("gpus", ""), ("cpus-per-gpu", "4"), ("mem-per-gpu", "1G")]),
        ] {
            assert_eq!(move_gpu_asks(&v, "gres:"), Moved::default(), "{v:?}");
        }
        // Unset numbers read as "0" and no memory.
        let m = move_gpu_asks(&values(&[("gpus", "1"), ("cpus-per-gpu", "0")]), "gres:");
        assert_eq!(m.reset, ["gpus"]);
    }

    #[test]
    fn memory_sizes_read_back() {
        for (s, mb) in [
            ("512", 512),
            ("512M", 512),
            ("16G", 16384),
            ("1T", 1 << 20),
            ("2P", 2 << 30),
        ] {
            assert_eq!(mbytes(s), Some(mb), "{s}");
        }
        for s in ["", "G", "x", "1.5G", "99999999999999999999P"] {
            assert_eq!(mbytes(s), None, "{s}");
        }
    }

    #[test]
    fn the_envelope_round_trips_and_refuses_what_it_does_not_know() {
        let carry = vec![
            (Field::TresPerNode, "gres:gpu:1".to_string()),
            (Field::MemPerTres, "gres:gpu:1024".to_string()),
        ];
        let s = encode(&carry);
        assert_eq!(s, "tres_per_node=gres:gpu:1;mem_per_tres=gres:gpu:1024");
        assert_eq!(decode(&s).unwrap(), carry);
        assert_eq!(decode("").unwrap(), []);
        assert!(decode("partition=shared").unwrap_err().contains("\"partition\""));
        assert!(decode("tres_per_node").unwrap_err().contains("FIELD=VALUE"));
        let long = decode(&"x".repeat(100_000)).unwrap_err();
        assert!(long.len() < 120, "a client's text is cut short: {} bytes", long.len());
    }
}
