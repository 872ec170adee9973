//! The node's shared GPUs: listed in the config, or found through NVML (loaded at run time,
//! so the daemon starts on nodes without a driver); and what telemetry sees running on them.

use crate::config::{GpuSource, GpuSpec};

/// One process on a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcSample {
    pub pid: u32,
    /// GPU memory the process uses, MiB (`None` where the driver does not say).
    pub mem_mb: Option<u64>,
    /// Its share of the GPU's SM time over the last interval, percent.
    pub sm_util_pct: Option<u32>,
}

/// One GPU at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSample {
    pub index: u32,
    pub processes: Vec<ProcSample>,
}

/// Why no GPU list could be made.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "no [[gpu]] is listed in the config and NVML is unavailable ({0}); list the node's shared GPUs in the config"
    )]
    NoNvml(String),
    #[error("NVML: {0}")]
    Nvml(String),
}

/// The shared GPUs according to `source`.
pub fn discover(source: &GpuSource) -> Result<Vec<GpuSpec>, GpuError> {
    match source {
        GpuSource::Listed(gpus) => Ok(gpus.clone()),
        GpuSource::Nvml => {
            let nvml = nvml_wrapper::Nvml::init().map_err(|e| GpuError::NoNvml(e.to_string()))?;
            let count = nvml.device_count().map_err(|e| GpuError::Nvml(e.to_string()))?;
            (0..count)
                .map(|i| {
                    let dev = nvml.device_by_index(i).map_err(|e| GpuError::Nvml(e.to_string()))?;
                    let model = dev.name().map_err(|e| GpuError::Nvml(e.to_string()))?;
                    let mem = dev.memory_info().map_err(|e| GpuError::Nvml(e.to_string()))?;
                    Ok(GpuSpec {
                        index: i,
                        model: model_key(&model),
                        memory_mb: mem.total / (1024 * 1024),
                        uuid: dev.uuid().ok(),
                    })
                })
                .collect()
        }
    }
}

/// Each GPU's device number (`/dev/nvidiaN`), in NVML's index order: its minor number,
/// which need not be its index.
pub fn minor_numbers() -> Result<Vec<u32>, GpuError> {
    let nvml = nvml_wrapper::Nvml::init().map_err(|e| GpuError::NoNvml(e.to_string()))?;
    let count = nvml.device_count().map_err(|e| GpuError::Nvml(e.to_string()))?;
    (0..count)
        .map(|i| {
            let dev = nvml.device_by_index(i).map_err(|e| GpuError::Nvml(e.to_string()))?;
            dev.minor_number().map_err(|e| GpuError::Nvml(e.to_string()))
        })
        .collect()
}

/// A history key from NVML's marketing name: "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3".
pub fn model_key(name: &str) -> String {
    let lower = name.to_ascii_lowercase();
    let trimmed = lower.strip_prefix("nvidia ").unwrap_or(&lower);
    trimmed.split_whitespace().collect::<Vec<_>>().join("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_keys() {
        assert_eq!(model_key("NVIDIA H100 80GB HBM3"), "h100-80gb-hbm3");
        assert_eq!(model_key("Tesla V100-SXM2-16GB"), "tesla-v100-sxm2-16gb");
    }

    #[test]
    fn listed_gpus_need_no_driver() {
        let g = vec![GpuSpec {
            index: 0,
            model: "v100".into(),
            memory_mb: 16384,
            uuid: None,
        }];
        assert_eq!(discover(&GpuSource::Listed(g.clone())).unwrap(), g);
    }
}
