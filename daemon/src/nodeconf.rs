//! A GPU node's configuration, written from its facts (`multiplexd node-config`): the lines
//! gres.conf needs for its shared GPUs (each GPU a Type of its own, `MODEL_INDEX`, on its gpu
//! and its shard line, as claims name it), its slurm.conf `NodeName` line (the typed GPUs,
//! the shards, the GPU models as node features), and its multiplexd.toml (the node, jobs per
//! GPU and its `[[gpu]]` list). One generator for the admin, the test clusters
//! (`tests/cluster/up`) and the containers (`deploy/containers/entrypoint`).
//!
//! The facts come from NVML on a GPU node, or are given (on the controller, in tests).

use crate::config::GpuSpec;
use multiplex_protocol::gres::gpu_type;

/// What a node's configuration is written from.
#[derive(Debug, Clone, PartialEq)]
pub struct Facts {
    /// The Slurm node name.
    pub node: String,
    /// Its shared GPUs.
    pub gpus: Vec<GpuSpec>,
    /// Jobs per GPU (its shards).
    pub jobs_per_gpu: u32,
    /// Each GPU's device file: `%g` is replaced by its device number.
    pub device: String,
    /// Each GPU's device number (NVML's minor number), by position in `gpus`; empty: its index.
    pub minors: Vec<u32>,
}

impl Facts {
    fn device_of(&self, k: usize) -> String {
        let number = self.minors.get(k).copied().unwrap_or(self.gpus[k].index);
        self.device.replace("%g", &number.to_string())
    }
}

/// The gres.conf lines of the node's shared GPUs.
pub fn gres_conf(f: &Facts) -> String {
    let mut out = String::new();
    for (k, g) in f.gpus.iter().enumerate() {
        let (kind, file) = (gpu_type(&g.model, g.index), f.device_of(k));
        out.push_str(&format!("NodeName={} Name=gpu Type={kind} File={file}\n", f.node));
        out.push_str(&format!(
            "NodeName={} Name=shard Type={kind} Count={} File={file}\n",
            f.node, f.jobs_per_gpu
        ));
    }
    out
}

/// The node's slurm.conf line, less what only the site knows (CPUs, memory, addresses: add
/// them at its end): each GPU by its Type, the shards, and the GPU model as a feature, which
/// a plain job's request for the model becomes (`multiplex_protocol::model`). A node with GPUs
/// of several models gets no model feature, and a comment that says why: such a request, an
/// untyped count, could be given a GPU of another model there.
pub fn slurm_node(f: &Facts) -> String {
    let typed: Vec<String> = f
        .gpus
        .iter()
        .map(|g| format!("gpu:{}:1", gpu_type(&g.model, g.index)))
        .collect();
    let shards = f.jobs_per_gpu as usize * f.gpus.len();
    let mut models: Vec<&str> = f.gpus.iter().map(|g| g.model.as_str()).collect();
    models.sort_unstable();
    models.dedup();
    let line = format!("NodeName={} Gres={},shard:{shards}", f.node, typed.join(","));
    match models[..] {
        [model] => format!("{line} Features={model}\n"),
        _ => format!(
            "# {}: GPUs of {} models ({}), so no model feature: a plain job asking for a model \
             (asked for untyped, with the model as a feature) never comes here\n{line}\n",
            f.node,
            models.len(),
            models.join(", ")
        ),
    }
}

/// The node's `[[gpu]]` list for multiplexd.toml.
pub fn gpu_list(f: &Facts) -> String {
    let mut out = String::new();
    for g in &f.gpus {
        out.push_str(&format!(
            "\n[[gpu]]\nindex = {}\nmodel = \"{}\"\nmemory_mb = {}\n",
            g.index, g.model, g.memory_mb
        ));
        if let Some(uuid) = &g.uuid {
            out.push_str(&format!("uuid = \"{uuid}\"\n"));
        }
    }
    out
}

/// The node's multiplexd.toml: its name, jobs per GPU and GPUs; every other key at its
/// default (etc/multiplexd.toml lists them).
pub fn multiplexd_toml(f: &Facts) -> String {
    format!(
        "node = \"{}\"\njobs_per_gpu = {}\n{}",
        f.node,
        f.jobs_per_gpu,
        gpu_list(f)
    )
}

/// All three, each under a comment naming its file.
pub fn all(f: &Facts) -> String {
    format!(
        "# gres.conf\n{}\n# slurm.conf (add CPUs=, RealMemory= and the node's address)\n{}\n# multiplexd.toml\n{}",
        gres_conf(f),
        slurm_node(f),
        multiplexd_toml(f)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn eight() -> Facts {
        Facts {
            node: "gpu07".into(),
            gpus: (0..8)
                .map(|index| GpuSpec {
                    index,
                    model: "h100".into(),
                    memory_mb: 81559,
                    uuid: None,
                })
                .collect(),
            jobs_per_gpu: 2,
            device: "/dev/nvidia%g".into(),
            minors: vec![],
        }
    }

    #[test]
    fn an_eight_gpu_node_gets_sixteen_gres_lines_eight_types_and_eight_gpus() {
        let f = eight();
        let gres = gres_conf(&f);
        assert_eq!(gres.lines().count(), 16);
        assert_eq!(
            gres.lines().take(2).collect::<Vec<_>>(),
            [
                "NodeName=gpu07 Name=gpu Type=h100_0 File=/dev/nvidia0",
                "NodeName=gpu07 Name=shard Type=h100_0 Count=2 File=/dev/nvidia0"
            ]
        );
        assert!(gres.ends_with("NodeName=gpu07 Name=shard Type=h100_7 Count=2 File=/dev/nvidia7\n"));
        assert_eq!(
            slurm_node(&f),
            "NodeName=gpu07 Gres=gpu:h100_0:1,gpu:h100_1:1,gpu:h100_2:1,gpu:h100_3:1,gpu:h100_4:1,\
             gpu:h100_5:1,gpu:h100_6:1,gpu:h100_7:1,shard:16 Features=h100\n"
        );
        // The daemon reads the multiplexd.toml it writes, GPU for GPU.
        let toml = multiplexd_toml(&f);
        let c = Config::parse(&format!("database = \":memory:\"\n{toml}")).unwrap();
        assert_eq!(c.node, "gpu07");
        assert_eq!(c.jobs_per_gpu, 2);
        assert_eq!(c.gpus, crate::config::GpuSource::Listed(f.gpus.clone()));
    }

    #[test]
    fn a_node_of_two_models_gets_no_model_feature_and_says_why() {
        let mut f = eight();
        f.gpus[7].model = "a100".into();
        let line = slurm_node(&f);
        assert!(
            line.starts_with("# gpu07: GPUs of 2 models (a100, h100), so no model feature"),
            "{line}"
        );
        assert!(line.ends_with(",gpu:a100_7:1,shard:16\n"), "{line}");
        assert!(!line.contains("Features="), "{line}");
    }

    #[test]
    fn device_numbers_are_nvmls_minor_numbers_where_known() {
        let f = Facts {
            minors: vec![4, 5, 6, 7, 0, 1, 2, 3],
            device: "/srv/dev/n1/nvidia%g".into(),
            ..eight()
        };
        let gres = gres_conf(&f);
        assert!(
            gres.starts_with("NodeName=gpu07 Name=gpu Type=h100_0 File=/srv/dev/n1/nvidia4\n"),
            "{gres}"
        );
        assert!(all(&f).contains("# multiplexd.toml\nnode = \"gpu07\""));
    }
}
